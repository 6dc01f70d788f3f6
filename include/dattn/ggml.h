/* dattn as a ggml operator: dattn_ggml_flash_attn_ext() builds a graph node with
 * ggml_flash_attn_ext()'s contract (tensor layouts, masks, GQA, result) that dattn computes.
 *
 *   struct ggml_tensor* out = dattn_ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0f, 0.0f);
 *   if (out == NULL) {   // bad input: nothing was added to the graph
 *     fprintf(stderr, "%s\n", dattn_last_error());
 *     out = ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0f, 0.0f);
 *   }
 *
 * - Library libdattn_ggml (CMake target dattn::dattn_ggml), built when CMake finds ggml
 *   (find_package(ggml)); it links libdattn_c (dattn/dattn.h) and ggml. C99 and C++.
 * - Tensors, as ggml_flash_attn_ext():
 *     q    F32            [D,  L_q, H,    N]
 *     k    F16/BF16/F32   [D,  L_k, H_kv, N]    (H % H_kv == 0: GQA; k and v of one type)
 *     v    F16/BF16/F32   [Dv, L_k, H_kv, N]    (not transposed)
 *     mask F16 or NULL    [>= L_k, >= L_q, H_m, N_m], contiguous; H % H_m == 0, N % N_m == 0
 *                         (broadcast over heads and batch); added to the scaled logits
 *     result F32          [Dv, H, L_q, N]       (permuted, contiguous)
 *   q, k and v may be views (any row, head and batch strides; elements of a row contiguous).
 *   A row whose keys are all masked (-inf) outputs zeros, as ggml's does; a key masked (-inf)
 *   from a row never reaches that row, whatever K and V hold there (NaN and inf included),
 *   also where other rows see it; a row that sees a NaN or inf in a V row is all NaN.
 * - Inputs are checked when the node is built: on bad input (a type, a shape, a broadcast,
 *   max_bias or logit_softcap other than 0, a backend option) the function returns NULL, adds
 *   nothing to the context and sets dattn_last_error() / dattn_last_error_field().
 * - Threads: ggml runs the node on every thread of its pool (GGML_N_TASKS_MAX). The rows
 *   N x H x L_q are split evenly over the nth threads (FLASH, REFERENCE: any rows; SAGE, which
 *   quantizes over a call's rows: whole heads); each thread runs its share as single-threaded
 *   dattn calls (one per head it touches), so no thread of dattn's own nests inside ggml's
 *   pool. The result does not depend on the thread count.
 * - Precision (dattn_ggml_options.precision, else $DATTN_GGML_PRECISION, else "auto"):
 *   "auto" computes in bf16 (FLASH's compute_dtype=bf16: Q, K, P and V rounded to bf16,
 *   products accumulated in f32) where the CPU has a fast bf16 engine (AMX tiles, or
 *   vdpbf16ps at >= 1.5x the f32 FMA rate), else in f32; "f32" always in f32. The backend
 *   (.backend, else $DATTN_GGML_BACKEND, else "FLASH") may be any dense dattn backend:
 *   "SAGE" computes Q.K^T in 8 bits (docs/semantics.md gives its error bounds).
 * - The node's userdata is a record interned for the life of the process, one per distinct
 *   (backend, precision, options, head sizes, scale): nothing to free, and a graph may be
 *   computed any number of times, from any thread, as long as the tensors live.
 * - A fault while computing (inputs were checked when the node was built, so only an
 *   allocation failure or a bug) cannot be returned from ggml's void operator: the rows of
 *   the failing call are set to NaN, and dattn_ggml_compute_errors() counts it and
 *   dattn_ggml_last_compute_error() keeps its message.
 * docs/stable-diffusion-cpp.md has the details and the figures.
 */
#ifndef DATTN_GGML_H
#define DATTN_GGML_H

#include <stddef.h>

#include <dattn/dattn.h>
#include <ggml.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dattn_ggml_options {
  size_t struct_size;         /* sizeof(dattn_ggml_options); set by dattn_ggml_options_init */
  const char* backend;        /* NULL: $DATTN_GGML_BACKEND, else "FLASH" */
  const char* precision;      /* "auto" or "f32"; NULL: $DATTN_GGML_PRECISION, else "auto" */
  const char* const* options; /* NULL-terminated "key=value" backend options, or NULL */
} dattn_ggml_options;

/* Fills `options` with the defaults (struct_size included). */
DATTN_C_API void dattn_ggml_options_init(dattn_ggml_options* options);

/* ggml_flash_attn_ext()'s node computed by dattn, with the default options. */
DATTN_C_API struct ggml_tensor* dattn_ggml_flash_attn_ext(
    struct ggml_context* ctx, struct ggml_tensor* q, struct ggml_tensor* k, struct ggml_tensor* v,
    struct ggml_tensor* mask, float scale, float max_bias, float logit_softcap);

/* The same with explicit options (NULL: the defaults). */
DATTN_C_API struct ggml_tensor* dattn_ggml_flash_attn_ext_with(
    struct ggml_context* ctx, struct ggml_tensor* q, struct ggml_tensor* k, struct ggml_tensor* v,
    struct ggml_tensor* mask, float scale, float max_bias, float logit_softcap,
    const dattn_ggml_options* options);

/* Faults while computing since the process started, and the last one's message ("" if none;
 * the calling thread's copy, valid until its next call of this function). */
DATTN_C_API long dattn_ggml_compute_errors(void);
DATTN_C_API const char* dattn_ggml_last_compute_error(void);

#ifdef __cplusplus
}
#endif

#endif /* DATTN_GGML_H */
