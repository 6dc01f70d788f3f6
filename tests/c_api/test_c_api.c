/* The C ABI (include/dattn/dattn.h) from C99: compiled and linked as C against libdattn_c.
 * Answers against a float64 reference written here; every error path returns its code, names
 * its field and writes nothing. Exit status 0 when every check passes. */
#include <dattn/dattn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

/* A CPU DLTensor over `data` of type (code, bits), compact (strides NULL) or strided. */
static DLTensor cpu_tensor(void* data, int code, int bits, int ndim, int64_t* shape,
                           int64_t* strides) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.dtype.code = (uint8_t)code;
  t.dtype.bits = (uint8_t)bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = strides;
  return t;
}

static DLTensor f32_tensor(float* data, int ndim, int64_t* shape, int64_t* strides) {
  return cpu_tensor(data, kDLFloat, 32, ndim, shape, strides);
}

static float uniform(unsigned* state) {
  *state = *state * 1664525u + 1013904223u;
  return (float)((*state >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}

/* out[b, i, h, :] = softmax(q . k^T * scale over visible keys) . v, BSHD, GQA by h / group;
 * lse[b, h, i]. keep: [B, S] key mask or NULL; valid: keys [0, valid) or -1. */
static void reference(const float* q, const float* k, const float* v, int B, int Sq, int Skv, int H,
                      int Hkv, int D, double scale, const unsigned char* keep, int valid,
                      double* out, double* lse) {
  int b, i, h, j, d;
  for (b = 0; b < B; ++b)
    for (i = 0; i < Sq; ++i)
      for (h = 0; h < H; ++h) {
        const int hk = h / (H / Hkv);
        double m = -INFINITY, l = 0, acc[64];
        for (d = 0; d < D; ++d) acc[d] = 0;
        for (j = 0; j < Skv; ++j) {
          double s = 0;
          if ((keep && !keep[b * Skv + j]) || (valid >= 0 && j >= valid)) continue;
          for (d = 0; d < D; ++d)
            s += (double)q[((b * Sq + i) * H + h) * D + d] * k[((b * Skv + j) * Hkv + hk) * D + d];
          s *= scale;
          if (s > m) {
            const double c = exp(m - s);
            l *= c;
            for (d = 0; d < D; ++d) acc[d] *= c;
            m = s;
          }
          l += exp(s - m);
          for (d = 0; d < D; ++d) acc[d] += exp(s - m) * v[((b * Skv + j) * Hkv + hk) * D + d];
        }
        for (d = 0; d < D; ++d) out[((b * Sq + i) * H + h) * D + d] = l > 0 ? acc[d] / l : 0;
        lse[(b * H + h) * Sq + i] = l > 0 ? m + log(l) : -INFINITY;
      }
}

static double max_diff(const float* got, const double* want, size_t n) {
  double worst = 0;
  size_t i;
  for (i = 0; i < n; ++i) {
    const double e = fabs((double)got[i] - want[i]);
    if (!(e <= worst)) worst = e; /* NaN counts as the worst */
  }
  return worst;
}

enum { B = 2, SQ = 13, SKV = 29, H = 4, HKV = 2, D = 24 };

int main(void) {
  static float q[B * SQ * H * D], k[B * SKV * HKV * D], v[B * SKV * HKV * D];
  static float out[B * SQ * H * D], lse[B * H * SQ], qt[B * H * SQ * D];
  static double want[B * SQ * H * D], want_lse[B * H * SQ];
  static unsigned char keep[B * SKV];
  int64_t qs[4] = {B, SQ, H, D}, ks[4] = {B, SKV, HKV, D}, ls[3] = {B, H, SQ};
  unsigned seed = 7;
  size_t n;
  int b, i, h, d, rc;
  dattn_layer_config config;
  dattn_layer* layer = NULL;
  DLTensor tq, tk, tv, to, tl;
  const double scale = 1.0 / sqrt((double)D);

  for (n = 0; n < sizeof q / sizeof *q; ++n) q[n] = uniform(&seed);
  for (n = 0; n < sizeof k / sizeof *k; ++n) k[n] = uniform(&seed);
  for (n = 0; n < sizeof v / sizeof *v; ++n) v[n] = uniform(&seed);
  tq = f32_tensor(q, 4, qs, NULL);
  tk = f32_tensor(k, 4, ks, NULL);
  tv = f32_tensor(v, 4, ks, NULL);
  to = f32_tensor(out, 4, qs, NULL);
  tl = f32_tensor(lse, 3, ls, NULL);

  /* Versions. */
  CHECK(dattn_abi_version() == DATTN_ABI_VERSION);
  CHECK(strlen(dattn_version()) > 0);
  /* A library layered on the ABI reports through the same message. */
  CHECK(dattn_set_last_error(DATTN_UNSUPPORTED, "mask", "mask: not served") == DATTN_UNSUPPORTED);
  CHECK(strcmp(dattn_last_error(), "mask: not served") == 0);
  CHECK(strcmp(dattn_last_error_field(), "mask") == 0);
  CHECK(dattn_set_last_error(DATTN_OK, NULL, NULL) == DATTN_OK && dattn_last_error()[0] == 0);

  /* Defaults. */
  dattn_layer_config_init(&config);
  CHECK(config.struct_size == sizeof config);
  CHECK(config.num_kv_heads == 0 && config.softmax_scale == 0.0f && config.backend == NULL);

  /* FLASH, GQA 4:2, with the LSE. */
  config.num_heads = H;
  config.num_kv_heads = HKV;
  config.head_size = D;
  config.backend = "FLASH";
  config.threads = 2;
  rc = dattn_layer_create(&config, &layer);
  CHECK(rc == DATTN_OK && layer != NULL);
  if (layer == NULL) {
    fprintf(stderr, "dattn_layer_create: %s\n", dattn_last_error());
    return 1;
  }
  CHECK(strcmp(dattn_layer_backend(layer), "FLASH") == 0);
  rc = dattn_forward(layer, &tq, &tk, &tv, NULL, &to, &tl);
  CHECK(rc == DATTN_OK);
  reference(q, k, v, B, SQ, SKV, H, HKV, D, scale, NULL, -1, want, want_lse);
  CHECK(max_diff(out, want, sizeof out / sizeof *out) < 1e-5);
  CHECK(max_diff(lse, want_lse, sizeof lse / sizeof *lse) < 1e-5);

  /* Strided query: the same values laid out [B, H, Sq, D] in memory, read as BSHD. */
  {
    int64_t strides[4] = {H * SQ * D, D, SQ * D, 1};
    DLTensor strided;
    for (b = 0; b < B; ++b)
      for (i = 0; i < SQ; ++i)
        for (h = 0; h < H; ++h)
          for (d = 0; d < D; ++d)
            qt[((b * H + h) * SQ + i) * D + d] = q[((b * SQ + i) * H + h) * D + d];
    strided = f32_tensor(qt, 4, qs, strides);
    memset(out, 0, sizeof out);
    CHECK(dattn_forward(layer, &strided, &tk, &tv, NULL, &to, NULL) == DATTN_OK);
    CHECK(max_diff(out, want, sizeof out / sizeof *out) < 1e-5);
  }

  /* A key mask (bool: DATTN_DL_BOOL) and valid_kv_length through dattn_call. */
  {
    int64_t ms[2] = {B, SKV};
    DLTensor mask;
    dattn_call call;
    for (n = 0; n < sizeof keep; ++n) keep[n] = (unsigned char)(n % 3 != 1);
    mask = cpu_tensor(keep, DATTN_DL_BOOL, 8, 2, ms, NULL);
    dattn_call_init(&call);
    CHECK(call.struct_size == sizeof call && call.valid_kv_length == -1);
    call.attn_mask = &mask;
    /* Cross-attention shapes (Sq != Skv): the key mask hides keys, no row is padding. */
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_OK);
    reference(q, k, v, B, SQ, SKV, H, HKV, D, scale, keep, -1, want, want_lse);
    CHECK(max_diff(out, want, sizeof out / sizeof *out) < 1e-5);
    call.attn_mask = NULL;
    call.valid_kv_length = 17;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_OK);
    reference(q, k, v, B, SQ, SKV, H, HKV, D, scale, NULL, 17, want, want_lse);
    CHECK(max_diff(out, want, sizeof out / sizeof *out) < 1e-5);

    /* Bad metadata: a code, the field, nothing written. */
    for (n = 0; n < sizeof out / sizeof *out; ++n) out[n] = 42.0f;
    call.valid_kv_length = -5;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "valid_kv_length") == 0);
    call.valid_kv_length = -1;
    call.joint_strategy = 7;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "joint_strategy") == 0);
    call.joint_strategy = DATTN_JOINT_FRONT;
    call.struct_size = 3;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "struct_size") == 0);
    for (n = 0; n < sizeof out / sizeof *out; ++n) CHECK(out[n] == 42.0f);
  }

  /* Bad tensors: a code naming the tensor, nothing written. */
  {
    int64_t wrong[4] = {B, SQ, H, D + 1};
    DLTensor bad = f32_tensor(q, 4, wrong, NULL);
    for (n = 0; n < sizeof out / sizeof *out; ++n) out[n] = 42.0f;
    CHECK(dattn_forward(layer, NULL, &tk, &tv, NULL, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "query") == 0);
    CHECK(dattn_forward(layer, &bad, &tk, &tv, NULL, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strlen(dattn_last_error()) > 0);
    CHECK(dattn_forward(layer, &tq, &tk, &tv, NULL, NULL, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "out") == 0);
    CHECK(dattn_forward(NULL, &tq, &tk, &tv, NULL, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "layer") == 0);
    for (n = 0; n < sizeof out / sizeof *out; ++n) CHECK(out[n] == 42.0f);
  }

  /* A DLTensor with real data and ndim > 0 but a NULL shape, in every place a tensor goes: a
   * code naming the tensor (the conversion must not read the shape), nothing written. */
  {
    DLTensor noshape[5];
    const char* names[5] = {"query", "key", "value", "out", "lse"};
    DLTensor *args[5], *good[5] = {&tq, &tk, &tv, &to, &tl};
    static unsigned char mask_bytes[B * SKV];
    static int32_t cu[3] = {0, SQ, SQ};
    DLTensor tm, tc;
    dattn_call call;
    int a, c;
    for (a = 0; a < 5; ++a) {
      for (c = 0; c < 5; ++c) args[c] = good[c];
      noshape[a] = *good[a];
      noshape[a].shape = NULL;
      args[a] = &noshape[a];
      for (n = 0; n < sizeof out / sizeof *out; ++n) out[n] = 42.0f;
      for (n = 0; n < sizeof lse / sizeof *lse; ++n) lse[n] = 42.0f;
      CHECK(dattn_forward(layer, args[0], args[1], args[2], NULL, args[3], args[4]) ==
            DATTN_INVALID_ARGUMENT);
      CHECK(strcmp(dattn_last_error_field(), names[a]) == 0);
      CHECK(strstr(dattn_last_error(), "shape") != NULL);
      for (n = 0; n < sizeof out / sizeof *out; ++n) CHECK(out[n] == 42.0f);
      for (n = 0; n < sizeof lse / sizeof *lse; ++n) CHECK(lse[n] == 42.0f);
    }
    tm = cpu_tensor(mask_bytes, DATTN_DL_BOOL, 8, 2, NULL, NULL);
    tc = cpu_tensor(cu, kDLInt, 32, 1, NULL, NULL);
    for (n = 0; n < sizeof out / sizeof *out; ++n) out[n] = 42.0f;
    dattn_call_init(&call);
    call.attn_mask = &tm;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "attn_mask") == 0);
    dattn_call_init(&call);
    call.cu_seqlens_q = &tc;
    call.cu_seqlens_k = &tc;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "cu_seqlens_q") == 0);
    dattn_call_init(&call);
    noshape[0] = tq;
    noshape[0].shape = NULL;
    call.joint_query = &noshape[0];
    call.joint_key = &tk;
    call.joint_value = &tv;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, &call, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "joint_query") == 0);
    /* NULL data with a non-zero byte_offset is no tensor either. */
    noshape[0] = tq;
    noshape[0].data = NULL;
    noshape[0].byte_offset = 64;
    CHECK(dattn_forward(layer, &noshape[0], &tk, &tv, NULL, &to, NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "query") == 0);
    for (n = 0; n < sizeof out / sizeof *out; ++n) CHECK(out[n] == 42.0f);
  }
  /* The memory dattn keeps between calls: the buffers of finished calls stay idle, shared by
   * every layer, until dattn_empty_cache (or the last layer's destruction) returns them. */
  {
    dattn_memory_stats stats, small;
    size_t returned;
    memset(&stats, 0xff, sizeof stats);
    stats.struct_size = sizeof stats;
    CHECK(dattn_forward(layer, &tq, &tk, &tv, NULL, &to, NULL) == DATTN_OK);
    CHECK(dattn_get_memory_stats(&stats) == DATTN_OK);
    CHECK(stats.live_layers == 1 && stats.calls_in_flight == 0);
    CHECK(stats.idle_buffers > 0 && stats.idle_bytes > 0);
    returned = dattn_empty_cache();
    CHECK(returned == stats.idle_bytes);
    CHECK(dattn_get_memory_stats(&stats) == DATTN_OK);
    CHECK(stats.idle_bytes == 0 && stats.idle_buffers == 0);
    CHECK(dattn_empty_cache() == 0);
    CHECK(dattn_forward(layer, &tq, &tk, &tv, NULL, &to, NULL) == DATTN_OK); /* maps anew */
    reference(q, k, v, B, SQ, SKV, H, HKV, D, scale, NULL, -1, want, want_lse);
    CHECK(max_diff(out, want, sizeof out / sizeof *out) < 1e-5);
    small.struct_size = sizeof small - 1;
    CHECK(dattn_get_memory_stats(&small) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "stats.struct_size") == 0);
    CHECK(dattn_get_memory_stats(NULL) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "stats") == 0);
  }
  dattn_layer_destroy(layer);
  dattn_layer_destroy(NULL);
  {
    dattn_memory_stats stats;
    stats.struct_size = sizeof stats;
    CHECK(dattn_get_memory_stats(&stats) == DATTN_OK);
    CHECK(stats.live_layers == 0 && stats.idle_bytes == 0); /* the last layer empties */
  }

  /* Options as "key=value" strings, checked as the CLI checks them. */
  {
    const char* sage[] = {"pv_dtype=f32", "smooth_k=true", NULL};
    const char* unknown[] = {"sparsity=0.9", NULL};
    const char* malformed[] = {"pv_dtype", NULL};
    dattn_layer* l2 = NULL;
    config.backend = "SAGE";
    config.options = sage;
    CHECK(dattn_layer_create(&config, &l2) == DATTN_OK);
    if (l2 != NULL) {
      CHECK(dattn_forward(l2, &tq, &tk, &tv, NULL, &to, NULL) == DATTN_OK);
      reference(q, k, v, B, SQ, SKV, H, HKV, D, scale, NULL, -1, want, want_lse);
      CHECK(max_diff(out, want, sizeof out / sizeof *out) < 0.05);
      dattn_layer_destroy(l2);
    }
    config.backend = "FLASH";
    config.options = unknown;
    l2 = (dattn_layer*)&config; /* set to NULL on failure */
    CHECK(dattn_layer_create(&config, &l2) == DATTN_INVALID_ARGUMENT && l2 == NULL);
    CHECK(strstr(dattn_last_error(), "sparsity") != NULL);
    config.options = malformed;
    CHECK(dattn_layer_create(&config, &l2) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "options") == 0);
    config.options = NULL;
  }

  /* Bad configurations. */
  {
    dattn_layer* l3 = NULL;
    config.backend = "NO_SUCH_BACKEND";
    CHECK(dattn_layer_create(&config, &l3) == DATTN_INVALID_ARGUMENT && l3 == NULL);
    CHECK(strcmp(dattn_last_error_field(), "backend") == 0);
    config.backend = NULL;
    config.head_size = 0;
    CHECK(dattn_layer_create(&config, &l3) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "head_size") == 0);
    config.head_size = D;
    config.num_kv_heads = 3; /* 4 query heads: not a multiple */
    CHECK(dattn_layer_create(&config, &l3) == DATTN_INVALID_ARGUMENT);
    CHECK(strstr(dattn_last_error(), "num_kv_heads") != NULL);
    config.num_kv_heads = HKV;
    config.struct_size = 4;
    CHECK(dattn_layer_create(&config, &l3) == DATTN_INVALID_ARGUMENT);
    CHECK(strcmp(dattn_last_error_field(), "struct_size") == 0);
    CHECK(dattn_layer_create(NULL, &l3) == DATTN_INVALID_ARGUMENT);
    CHECK(dattn_layer_create(&config, NULL) == DATTN_INVALID_ARGUMENT);
  }

  if (failures == 0) printf("c_api: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
