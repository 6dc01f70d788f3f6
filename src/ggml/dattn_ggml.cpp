// dattn_ggml_flash_attn_ext (include/dattn/ggml.h): ggml_flash_attn_ext's node on ggml's
// custom-op API, computed through dattn's C ABI. Inputs are checked when the node is built;
// the operator splits the rows over ggml's threads, each share single-threaded dattn calls.
#include "dattn/ggml.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

// What a node's compute needs besides its tensors: the dattn layer (one head, the node's head
// sizes, scale, backend and options). Interned for the life of the process.
struct NodeRecord {
  dattn_layer* layer = nullptr;
  // Whether a thread's share must be whole heads: the exact backends (FLASH, REFERENCE)
  // compute each row on its own, so any split of the rows gives the same answer; the others
  // (SAGE) quantize and smooth over the rows of a call, so only calls over whole heads keep
  // the result independent of ggml's thread count.
  bool whole_heads = false;
};

std::mutex g_records_mutex;
std::map<std::string, std::unique_ptr<NodeRecord>>& records() {
  static auto* map = new std::map<std::string, std::unique_ptr<NodeRecord>>();  // never freed
  return *map;
}

std::mutex g_compute_error_mutex;
std::atomic<long> g_compute_errors{0};
std::string& compute_error() {
  static auto* message = new std::string();
  return *message;
}

// A failure reported through the C ABI's thread-local message; returns NULL for the caller.
ggml_tensor* refuse(int status, const char* field, const std::string& message) {
  dattn_set_last_error(status, field, message.c_str());
  return nullptr;
}

const char* type_name(ggml_type t) {
  return ggml_type_name(t);
}

bool dl_dtype(ggml_type t, DLDataType* out) {
  switch (t) {
    case GGML_TYPE_F32:
      *out = DLDataType{kDLFloat, 32, 1};
      return true;
    case GGML_TYPE_F16:
      *out = DLDataType{kDLFloat, 16, 1};
      return true;
    case GGML_TYPE_BF16:
      *out = DLDataType{kDLBfloat, 16, 1};
      return true;
    default:
      return false;
  }
}

// Strides of `t` in elements (ggml's are in bytes); false if one is not a whole number of them.
bool element_strides(const ggml_tensor* t, std::int64_t out[4]) {
  const std::size_t es = ggml_type_size(t->type);
  for (int d = 0; d < 4; ++d) {
    if (t->nb[d] % es != 0) return false;
    out[d] = static_cast<std::int64_t>(t->nb[d] / es);
  }
  return true;
}

std::string shape_of(const ggml_tensor* t) {
  return "[" + std::to_string(t->ne[0]) + ", " + std::to_string(t->ne[1]) + ", " +
         std::to_string(t->ne[2]) + ", " + std::to_string(t->ne[3]) + "]";
}

// Rows [l0, l1) of head h, batch item n: one single-threaded dattn call into dst.
int run_call(const NodeRecord& record, ggml_tensor* dst, std::int64_t n, std::int64_t h,
             std::int64_t l0, std::int64_t l1) {
  const ggml_tensor* q = dst->src[0];
  const ggml_tensor* k = dst->src[1];
  const ggml_tensor* v = dst->src[2];
  const ggml_tensor* mask = dst->src[3];
  const std::int64_t heads = q->ne[2], group = heads / k->ne[2], kv_head = h / group;
  const std::int64_t rows = l1 - l0, lk = k->ne[1], d = q->ne[0], dv = v->ne[0];

  std::int64_t qs[4], ks[4], vs[4];
  element_strides(q, qs);
  element_strides(k, ks);
  element_strides(v, vs);
  DLDataType f32{kDLFloat, 32, 1}, kv_type{};
  dl_dtype(k->type, &kv_type);
  const DLDevice cpu{kDLCPU, 0};

  // BSHD views of one head: [1, rows, 1, D].
  std::int64_t q_shape[4] = {1, rows, 1, d}, q_strides[4] = {qs[3], qs[1], qs[2], 1};
  std::int64_t k_shape[4] = {1, lk, 1, d}, k_strides[4] = {ks[3], ks[1], ks[2], 1};
  std::int64_t v_shape[4] = {1, lk, 1, dv}, v_strides[4] = {vs[3], vs[1], vs[2], 1};
  // The result [Dv, H, L_q, N] is BSHD [N, L_q, H, Dv], compact.
  std::int64_t o_shape[4] = {1, rows, 1, dv},
               o_strides[4] = {q->ne[1] * heads * dv, heads * dv, dv, 1};

  DLTensor qt{}, kt{}, vt{}, ot{}, mt{};
  qt.data = static_cast<char*>(q->data) + n * q->nb[3] + h * q->nb[2] + l0 * q->nb[1];
  qt.device = cpu;
  qt.ndim = 4;
  qt.dtype = f32;
  qt.shape = q_shape;
  qt.strides = q_strides;
  kt.data = static_cast<char*>(k->data) + n * k->nb[3] + kv_head * k->nb[2];
  kt.device = cpu;
  kt.ndim = 4;
  kt.dtype = kv_type;
  kt.shape = k_shape;
  kt.strides = k_strides;
  vt = kt;
  vt.data = static_cast<char*>(v->data) + n * v->nb[3] + kv_head * v->nb[2];
  vt.shape = v_shape;
  vt.strides = v_strides;
  ot.data = static_cast<char*>(dst->data) + ((n * q->ne[1] + l0) * heads + h) * dv * sizeof(float);
  ot.device = cpu;
  ot.ndim = 4;
  ot.dtype = f32;
  ot.shape = o_shape;
  ot.strides = o_strides;

  dattn_call call;
  dattn_call_init(&call);
  std::int64_t m_shape[4] = {1, 1, rows, lk}, m_strides[4] = {0, 0, 0, 1};
  if (mask != nullptr) {
    // ggml reads mask plane (h % ne2, n % ne3), rows l, keys [0, L_k).
    m_strides[2] = static_cast<std::int64_t>(mask->nb[1] / sizeof(ggml_fp16_t));
    mt.data = static_cast<char*>(mask->data) + (h % mask->ne[2]) * mask->nb[2] +
              (n % mask->ne[3]) * mask->nb[3] + l0 * mask->nb[1];
    mt.device = cpu;
    mt.ndim = 4;
    mt.dtype = DLDataType{kDLFloat, 16, 1};
    mt.shape = m_shape;
    mt.strides = m_strides;
    call.attn_mask = &mt;
  }
  // A tensor without data (a graph computed before its buffers were allocated) reaches dattn
  // as NULL, which refuses it, rather than as NULL plus an offset.
  if (q->data == nullptr) qt.data = nullptr;
  if (k->data == nullptr) kt.data = nullptr;
  if (v->data == nullptr) vt.data = nullptr;
  if (dst->data == nullptr) ot.data = nullptr;
  if (mask != nullptr && mask->data == nullptr) mt.data = nullptr;
  return dattn_forward(record.layer, &qt, &kt, &vt, mask != nullptr ? &call : nullptr, &ot,
                       nullptr);
}

void fill_nan(ggml_tensor* dst, std::int64_t n, std::int64_t h, std::int64_t l0, std::int64_t l1) {
  if (dst->data == nullptr) return;
  const std::int64_t heads = dst->ne[1], dv = dst->ne[0], lq = dst->ne[2];
  for (std::int64_t l = l0; l < l1; ++l) {
    float* row = static_cast<float*>(dst->data) + ((n * lq + l) * heads + h) * dv;
    std::fill(row, row + dv, std::numeric_limits<float>::quiet_NaN());
  }
}

void compute(ggml_tensor* dst, int ith, int nth, void* userdata) {
  const auto& record = *static_cast<const NodeRecord*>(userdata);
  const ggml_tensor* q = dst->src[0];
  const std::int64_t lq = q->ne[1], heads = q->ne[2], batch = q->ne[3];
  // Rows in (n, h, l) order, in units of one row (or one whole head), split evenly: thread ith
  // takes rows [r0, r1).
  const std::int64_t unit = record.whole_heads ? lq : 1, units = lq * heads * batch / unit;
  const std::int64_t r0 = units * ith / nth * unit, r1 = units * (ith + 1) / nth * unit;
  for (std::int64_t r = r0; r < r1;) {
    const std::int64_t n = r / (lq * heads), h = (r / lq) % heads, l0 = r % lq;
    const std::int64_t l1 = std::min(lq, l0 + (r1 - r));
    if (run_call(record, dst, n, h, l0, l1) != DATTN_OK) {
      fill_nan(dst, n, h, l0, l1);
      std::lock_guard<std::mutex> lock(g_compute_error_mutex);
      compute_error() = dattn_last_error();
      g_compute_errors.fetch_add(1);
    }
    r += l1 - l0;
  }
}

const char* env_or(const char* given, const char* name, const char* fallback) {
  if (given != nullptr) return given;
  const char* e = std::getenv(name);
  return e != nullptr && *e != '\0' ? e : fallback;
}

std::string lowercase(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The interned record of a configuration, created (and its layer checked) on first use.
NodeRecord* record_for(const std::string& backend, const std::string& precision,
                       const std::vector<std::string>& options, int head_size, float scale) {
  std::string key = backend + "\n" + precision + "\n" + std::to_string(head_size) + "\n";
  std::uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale, sizeof scale);
  key += std::to_string(scale_bits);
  for (const auto& o : options) key += "\n" + o;

  std::lock_guard<std::mutex> lock(g_records_mutex);
  auto& map = records();
  if (auto it = map.find(key); it != map.end()) return it->second.get();

  std::vector<const char*> option_ptrs;
  for (const auto& o : options) option_ptrs.push_back(o.c_str());
  option_ptrs.push_back(nullptr);
  dattn_layer_config config;
  dattn_layer_config_init(&config);
  config.num_heads = 1;
  config.num_kv_heads = 1;
  config.head_size = head_size;
  config.softmax_scale = scale;
  config.backend = backend.c_str();
  config.options = option_ptrs.data();
  config.threads = 1;
  config.prefix = "dattn_ggml_flash_attn_ext";
  dattn_layer* layer = nullptr;
  if (dattn_layer_create(&config, &layer) != DATTN_OK) return nullptr;  // message set
  auto record = std::make_unique<NodeRecord>();
  record->layer = layer;
  const std::string resolved = dattn_layer_backend(layer);
  record->whole_heads = resolved != "FLASH" && resolved != "REFERENCE";
  NodeRecord* raw = record.get();
  map.emplace(std::move(key), std::move(record));
  return raw;
}

bool check_tensor(const ggml_tensor* t, const char* field) {
  if (t == nullptr) {
    refuse(DATTN_INVALID_ARGUMENT, field, std::string(field) + ": is NULL");
    return false;
  }
  return true;
}

}  // namespace

extern "C" {

void dattn_ggml_options_init(dattn_ggml_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof *options);
  options->struct_size = sizeof *options;
}

ggml_tensor* dattn_ggml_flash_attn_ext(ggml_context* ctx, ggml_tensor* q, ggml_tensor* k,
                                       ggml_tensor* v, ggml_tensor* mask, float scale,
                                       float max_bias, float logit_softcap) {
  return dattn_ggml_flash_attn_ext_with(ctx, q, k, v, mask, scale, max_bias, logit_softcap,
                                        nullptr);
}

ggml_tensor* dattn_ggml_flash_attn_ext_with(ggml_context* ctx, ggml_tensor* q, ggml_tensor* k,
                                            ggml_tensor* v, ggml_tensor* mask, float scale,
                                            float max_bias, float logit_softcap,
                                            const dattn_ggml_options* options) {
  try {
    if (ctx == nullptr) return refuse(DATTN_INVALID_ARGUMENT, "ctx", "ctx: is NULL");
    if (!check_tensor(q, "q") || !check_tensor(k, "k") || !check_tensor(v, "v")) return nullptr;
    if (options != nullptr && options->struct_size < sizeof(dattn_ggml_options))
      return refuse(DATTN_INVALID_ARGUMENT, "struct_size",
                    "struct_size: of dattn_ggml_options is " +
                        std::to_string(options->struct_size) +
                        "; set it with dattn_ggml_options_init");
    if (q->type != GGML_TYPE_F32)
      return refuse(DATTN_INVALID_ARGUMENT, "q",
                    std::string("q: type ") + type_name(q->type) + " is not valid; valid: f32");
    DLDataType dt{};
    if (!dl_dtype(k->type, &dt))
      return refuse(
          DATTN_INVALID_ARGUMENT, "k",
          std::string("k: type ") + type_name(k->type) + " is not valid; valid: f16, bf16, f32");
    if (v->type != k->type)
      return refuse(DATTN_INVALID_ARGUMENT, "v",
                    std::string("v: type ") + type_name(v->type) + " differs from k's (" +
                        type_name(k->type) + "); k and v must be of one type");
    const std::int64_t d = q->ne[0], lq = q->ne[1], heads = q->ne[2], batch = q->ne[3];
    if (k->ne[0] != d)
      return refuse(DATTN_INVALID_ARGUMENT, "k",
                    "k: head size ne[0] = " + std::to_string(k->ne[0]) + " differs from q's " +
                        std::to_string(d) + " (q " + shape_of(q) + ", k " + shape_of(k) + ")");
    if (v->ne[1] != k->ne[1] || v->ne[2] != k->ne[2] || v->ne[3] != k->ne[3])
      return refuse(DATTN_INVALID_ARGUMENT, "v",
                    "v: " + shape_of(v) + " must be [Dv, L_k, H_kv, N] with k's " + shape_of(k));
    if (k->ne[3] != batch)
      return refuse(DATTN_INVALID_ARGUMENT, "k",
                    "k: batch ne[3] = " + std::to_string(k->ne[3]) + " differs from q's " +
                        std::to_string(batch));
    if (k->ne[2] < 1 || heads % k->ne[2] != 0)
      return refuse(DATTN_INVALID_ARGUMENT, "k",
                    "k: " + std::to_string(k->ne[2]) + " kv heads (ne[2]) must divide q's " +
                        std::to_string(heads) + " heads");
    if (d < 1 || v->ne[0] < 1)
      return refuse(DATTN_INVALID_ARGUMENT, d < 1 ? "q" : "v", "head sizes must be >= 1");
    const struct {
      const ggml_tensor* t;
      const char* name;
    } operands[] = {{q, "q"}, {k, "k"}, {v, "v"}};
    for (const auto& o : operands) {
      std::int64_t strides[4];
      if (o.t->nb[0] != ggml_type_size(o.t->type) || !element_strides(o.t, strides))
        return refuse(DATTN_INVALID_ARGUMENT, o.name,
                      std::string(o.name) +
                          ": the elements of a row must be contiguous and the row, head and "
                          "batch strides whole elements");
    }
    if (mask != nullptr) {
      if (mask->type != GGML_TYPE_F16)
        return refuse(
            DATTN_INVALID_ARGUMENT, "mask",
            std::string("mask: type ") + type_name(mask->type) + " is not valid; valid: f16");
      if (!ggml_is_contiguous(mask))
        return refuse(DATTN_INVALID_ARGUMENT, "mask", "mask: must be contiguous");
      if (mask->ne[0] < k->ne[1] || mask->ne[1] < lq)
        return refuse(DATTN_INVALID_ARGUMENT, "mask",
                      "mask: " + shape_of(mask) + " must be at least [L_k, L_q] = [" +
                          std::to_string(k->ne[1]) + ", " + std::to_string(lq) + "]");
      if (mask->ne[2] < 1 || heads % mask->ne[2] != 0 || mask->ne[3] < 1 ||
          batch % mask->ne[3] != 0)
        return refuse(DATTN_INVALID_ARGUMENT, "mask",
                      "mask: " + shape_of(mask) + " must broadcast over q's " +
                          std::to_string(heads) + " heads and " + std::to_string(batch) +
                          " batch items (ne[2] dividing the heads, ne[3] the batch)");
    }
    if (!(std::isfinite(scale) && scale > 0.0f))
      return refuse(DATTN_INVALID_ARGUMENT, "scale",
                    "scale: must be a finite number > 0, got " + std::to_string(scale));
    if (max_bias != 0.0f)
      return refuse(DATTN_UNSUPPORTED, "max_bias",
                    "max_bias: ALiBi slopes (max_bias != 0) are not served; valid: 0");
    if (logit_softcap != 0.0f)
      return refuse(DATTN_UNSUPPORTED, "logit_softcap",
                    "logit_softcap: soft-capped logits are not served; valid: 0");

    const std::string backend =
        env_or(options != nullptr ? options->backend : nullptr, "DATTN_GGML_BACKEND", "FLASH");
    const std::string precision = lowercase(
        env_or(options != nullptr ? options->precision : nullptr, "DATTN_GGML_PRECISION", "auto"));
    std::vector<std::string> backend_options;
    if (options != nullptr && options->options != nullptr)
      for (const char* const* o = options->options; *o != nullptr; ++o)
        backend_options.emplace_back(*o);
    const std::string backend_lc = lowercase(backend);
    bool has_compute_dtype = false;
    for (const auto& o : backend_options)
      has_compute_dtype = has_compute_dtype || lowercase(o).rfind("compute_dtype", 0) == 0;
    if (precision != "auto" && precision != "f32")
      return refuse(DATTN_INVALID_ARGUMENT, "precision",
                    "precision: '" + precision +
                        "' is not valid (dattn_ggml_options.precision or DATTN_GGML_PRECISION); "
                        "valid: auto, f32");
    if (backend_lc == "flash" && !has_compute_dtype) {
      backend_options.emplace_back(precision == "auto" ? "compute_dtype=bf16"
                                                       : "compute_dtype=f32");
    } else if (precision == "f32" && backend_lc != "flash" && backend_lc != "reference") {
      return refuse(DATTN_INVALID_ARGUMENT, "precision",
                    "precision: 'f32' applies to FLASH (and REFERENCE, always exact); " + backend +
                        " chooses its own arithmetic: leave precision 'auto'");
    }
    if (d > std::numeric_limits<int>::max())
      return refuse(DATTN_INVALID_ARGUMENT, "q", "q: head size too large");
    NodeRecord* record =
        record_for(backend, precision, backend_options, static_cast<int>(d), scale);
    if (record == nullptr) return nullptr;  // dattn_layer_create's message

    ggml_tensor* args[4] = {q, k, v, mask};
    ggml_tensor* out = ggml_custom_4d(ctx, GGML_TYPE_F32, v->ne[0], heads, lq, batch, args,
                                      mask != nullptr ? 4 : 3, compute, GGML_N_TASKS_MAX, record);
    if (out == nullptr)
      return refuse(DATTN_OUT_OF_MEMORY, "ctx", "ctx: ggml_custom_4d returned NULL");
    return out;
  } catch (const std::bad_alloc&) {
    return refuse(DATTN_OUT_OF_MEMORY, "", "out of memory");
  } catch (const std::exception& e) {
    return refuse(DATTN_INTERNAL_ERROR, "", e.what());
  }
}

long dattn_ggml_compute_errors(void) {
  return g_compute_errors.load();
}

const char* dattn_ggml_last_compute_error(void) {
  thread_local std::string copy;
  std::lock_guard<std::mutex> lock(g_compute_error_mutex);
  copy = compute_error();
  return copy.c_str();
}

}  // extern "C"
