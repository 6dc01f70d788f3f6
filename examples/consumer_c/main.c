/* A C99 program on dattn's C ABI, built as a C consumer builds it (make install-check):
 *   cc -std=c99 main.c $(pkg-config --cflags --libs dattn-c)
 * One attention call on compact f32 tensors; prints the backend and one output value. */
#include <dattn/dattn.h>

#include <stdio.h>

int main(void) {
  static float q[1 * 8 * 2 * 16], k[1 * 8 * 2 * 16], v[1 * 8 * 2 * 16], out[1 * 8 * 2 * 16];
  int64_t shape[4] = {1, 8, 2, 16};
  DLTensor tq = {0}, tk, tv, to;
  dattn_layer_config config;
  dattn_layer* layer = NULL;
  int i, rc;
  for (i = 0; i < 8 * 2 * 16; ++i) {
    q[i] = (float)(i % 7) * 0.1f;
    k[i] = (float)(i % 5) * 0.1f;
    v[i] = (float)(i % 3);
  }
  tq.device.device_type = kDLCPU;
  tq.ndim = 4;
  tq.dtype.code = kDLFloat;
  tq.dtype.bits = 32;
  tq.dtype.lanes = 1;
  tq.shape = shape;
  tk = tv = to = tq;
  tq.data = q;
  tk.data = k;
  tv.data = v;
  to.data = out;

  dattn_layer_config_init(&config);
  config.num_heads = 2;
  config.head_size = 16;
  if (dattn_layer_create(&config, &layer) != DATTN_OK) {
    fprintf(stderr, "dattn_layer_create: %s\n", dattn_last_error());
    return 1;
  }
  rc = dattn_forward(layer, &tq, &tk, &tv, NULL, &to, NULL);
  if (rc != DATTN_OK)
    fprintf(stderr, "dattn_forward: %s\n", dattn_last_error());
  else
    printf("dattn %s (C ABI %d) on %s: out[0] = %.4f\n", dattn_version(), dattn_abi_version(),
           dattn_layer_backend(layer), out[0]);
  dattn_layer_destroy(layer);
  return rc == DATTN_OK ? 0 : 1;
}
