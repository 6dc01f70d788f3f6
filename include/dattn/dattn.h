/* dattn's stable C ABI (C99): attention layers over DLPack tensors, for programs and runtimes
 * that are not C++ (stable-diffusion.cpp and ggml, language bindings).
 *
 *   dattn_layer_config c;
 *   dattn_layer_config_init(&c);                  // defaults; c.struct_size set
 *   c.num_heads = 24; c.head_size = 128;
 *   dattn_layer* layer = NULL;
 *   if (dattn_layer_create(&c, &layer) != DATTN_OK) fprintf(stderr, "%s\n", dattn_last_error());
 *   int rc = dattn_forward(layer, &q, &k, &v, NULL, &out, NULL);   // q/k/v/out: DLTensors
 *   dattn_layer_destroy(layer);
 *
 * - One shared library, libdattn_c.so (pkg-config: dattn-c), exporting only the functions
 *   below: a C program compiles and links with the C compiler alone
 *   (cc prog.c $(pkg-config --cflags --libs dattn-c)); the C++ runtime and OpenMP come in as
 *   the library's own dependencies. docs/c_api.md has the details.
 * - Tensors are DLPack DLTensors in BSHD logical order ([batch, sequence, heads, head size]),
 *   any strides (NULL strides: compact row-major), f32, bf16 or f16, on the CPU. Masks are
 *   bool keep-masks (type code DATTN_DL_BOOL, DLPack's kDLBool, 8 bits) or float additive
 *   masks; cu_seqlens int32.
 * - No exception crosses this interface: every function that can fail returns a status code
 *   (dattn_status) and sets the calling thread's message (dattn_last_error) and the name of the
 *   field it is about (dattn_last_error_field). A call that fails writes nothing.
 * - Structs start with struct_size (the caller's sizeof): fields added later are read only
 *   from callers compiled with them. Initialise them with the *_init functions.
 * - The ABI version (DATTN_ABI_VERSION, dattn_abi_version()) changes only when something here
 *   changes incompatibly; the library's soname carries it (libdattn_c.so.1).
 */
#ifndef DATTN_DATTN_H
#define DATTN_DATTN_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#define DATTN_ABI_VERSION 1

/* DLPack's kDLBool type code (bool masks, 8 bits), which dlpack.h before DLPack 1.0 lacks. */
#define DATTN_DL_BOOL 6

#if defined(__GNUC__)
#define DATTN_C_API __attribute__((visibility("default")))
#else
#define DATTN_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes; the C++ errors map onto them one to one. */
typedef enum dattn_status {
  DATTN_OK = 0,
  DATTN_INVALID_ARGUMENT = 1, /* malformed input: a shape, dtype, range, option or field */
  DATTN_UNSUPPORTED = 2,      /* well formed, but the layer's backend does not serve it */
  DATTN_NOT_AVAILABLE = 3,    /* the backend or engine cannot run on this machine */
  DATTN_OUT_OF_MEMORY = 4,    /* an allocation failed */
  DATTN_INTERNAL_ERROR = 5    /* anything else (a bug: please report it) */
} dattn_status;

typedef struct dattn_layer dattn_layer;

typedef struct dattn_layer_config {
  size_t struct_size;         /* sizeof(dattn_layer_config); set by dattn_layer_config_init */
  int num_heads;              /* query heads (>= 1) */
  int num_kv_heads;           /* key/value heads; 0: num_heads (GQA: a divisor of num_heads) */
  int head_size;              /* D (>= 1) */
  float softmax_scale;        /* 0: 1 / sqrt(head_size) */
  int causal;                 /* nonzero: causal (bottom-right aligned, docs/semantics.md) */
  const char* backend;        /* "FLASH", "SAGE", "REFERENCE", ...; NULL or "auto": automatic */
  const char* const* options; /* NULL-terminated "key=value" backend options, or NULL */
  int threads;                /* OpenMP threads of each call; 0: OpenMP's default */
  const char* prefix;         /* the layer's name in messages; NULL: none */
} dattn_layer_config;

typedef enum dattn_joint_strategy {
  DATTN_JOINT_FRONT = 0,
  DATTN_JOINT_REAR = 1
} dattn_joint_strategy;

/* Per-call metadata (docs/semantics.md); every pointer may be NULL. */
typedef struct dattn_call {
  size_t struct_size;              /* sizeof(dattn_call); set by dattn_call_init */
  const DLTensor* attn_mask;       /* [B, Skv] bool, [B, Sq, Skv], [B|1, H|1, Sq, Skv] */
  const DLTensor* joint_query;     /* [B, J, Hq, D] joint (text) rows */
  const DLTensor* joint_key;       /* [B, J, Hkv, D] */
  const DLTensor* joint_value;     /* [B, J, Hkv, Dv] */
  const DLTensor* joint_attn_mask; /* [B, J] bool */
  int joint_strategy;              /* dattn_joint_strategy: where the joint rows go */
  const DLTensor* cu_seqlens_q;    /* int32 [docs + 1]: packed documents */
  const DLTensor* cu_seqlens_k;    /* int32 [docs + 1] */
  int64_t max_seqlen_q;            /* 0: not given */
  int64_t max_seqlen_k;            /* 0: not given */
  int64_t valid_kv_length;         /* keys [0, valid_kv_length) are real; -1: all */
} dattn_call;

/* Fills `config` with the defaults (struct_size included). */
DATTN_C_API void dattn_layer_config_init(dattn_layer_config* config);
/* Fills `call` with "no metadata" (struct_size included). */
DATTN_C_API void dattn_call_init(dattn_call* call);

/* Builds a layer (chooses and checks its backend and options). On success *out is the layer
 * (destroy it with dattn_layer_destroy); on failure *out is NULL. */
DATTN_C_API int dattn_layer_create(const dattn_layer_config* config, dattn_layer** out);
/* Frees a layer; NULL is ignored. */
DATTN_C_API void dattn_layer_destroy(dattn_layer* layer);

/* One attention call: `q` [B, Sq, Hq, D], `k` [B, Skv, Hkv, D], `v` [B, Skv, Hkv, Dv] into `out`
 * [B, J + Sq, Hq, Dv] (the query's dtype; joint rows included, in joint-strategy order) and,
 * when `lse` is not NULL, the f32 log-sum-exp [B, Hq, J + Sq]. `call` may be NULL. Nothing is
 * written unless it returns DATTN_OK. Calls on one layer may run from several threads. */
DATTN_C_API int dattn_forward(dattn_layer* layer, const DLTensor* q, const DLTensor* k,
                              const DLTensor* v, const dattn_call* call, DLTensor* out,
                              DLTensor* lse);

/* The backend the layer was built with (e.g. "FLASH"); "" for NULL. Valid while it lives. */
DATTN_C_API const char* dattn_layer_backend(const dattn_layer* layer);

/* The calling thread's last error message ("" if none yet), and the field it names (e.g.
 * "num_heads", "query", "options.sparsity"). Valid until the thread's next dattn call. */
DATTN_C_API const char* dattn_last_error(void);
DATTN_C_API const char* dattn_last_error_field(void);

/* Sets the calling thread's last error (status, field, message; NULL reads as ""), for
 * libraries layered on this ABI (dattn_ggml) that report through dattn_last_error. Returns
 * `status`. */
DATTN_C_API int dattn_set_last_error(int status, const char* field, const char* message);

/* What dattn holds between calls (docs/architecture.md, "Memory"): its large buffers are
 * mappings of the process, shared by every layer; those a call has finished with stay idle for
 * the next calls, at most as many as the calls in flight have held at once. */
typedef struct dattn_memory_stats {
  size_t struct_size;     /* sizeof(dattn_memory_stats): set it before the call */
  size_t idle_bytes;      /* kept for the next calls (what dattn_empty_cache returns) */
  size_t idle_buffers;
  size_t in_use_bytes;    /* leased to calls in flight, or results not yet freed */
  size_t calls_in_flight;
  size_t live_layers;     /* layers (C and C++) alive in the process */
} dattn_memory_stats;
/* Fills `stats` (the fields its struct_size covers); NULL or a too small struct_size is
 * DATTN_INVALID_ARGUMENT. */
DATTN_C_API int dattn_get_memory_stats(dattn_memory_stats* stats);
/* Returns dattn's idle buffers to the operating system; returns the bytes returned. Buffers in
 * use are untouched; done also when the process's last layer is destroyed. Any thread, any time. */
DATTN_C_API size_t dattn_empty_cache(void);

/* The library's version ("0.1.0") and ABI version (DATTN_ABI_VERSION it was built with). */
DATTN_C_API const char* dattn_version(void);
DATTN_C_API int dattn_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* DATTN_DATTN_H */
