// dattn._core: the compiled half of the Python package. It binds the public C++ API only: a
// layer (dattn::Attention) whose calls take tensors through DLPack (torch) or the array
// interface (numpy) without copies and release the GIL while they compute, the page pool, and
// the registry's backends as data. The Python layer (python/dattn/) gives it the seed's names.
//
// Tensor arguments: an object with __dlpack__ (kept alive for the call), a numpy array (read
// through __array_interface__, so read-only and broadcast arrays need no copy), or a tuple
// (tensor, "bool") for a bool tensor passed as its uint8 view (DLPack in PyTorch 1.13 refuses
// bool). Metadata arrives as a dict of plain values built by the Python layer per call; no view
// outlives the call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/capabilities.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/memory.hpp"
#include "dattn/page_pool.hpp"
#include "dattn/paged.hpp"
#include "dattn/registry.hpp"
#include "dattn/threads.hpp"
#include "dattn/video_sparse.hpp"

namespace py = pybind11;

namespace dattn::python {
namespace {

using i64 = std::int64_t;

[[noreturn]] void invalid(const std::string& field, const std::string& msg) {
  throw InvalidArgument(field, field + ": " + msg);
}

// The Python objects whose memory the views of one call point into.
using Keep = std::vector<py::object>;

DType dtype_from_typestr(const std::string& t, const std::string& field, bool as_bool) {
  if (t.size() >= 2 && (t[0] == '<' || t[0] == '|' || t[0] == '=')) {
    const std::string kind = t.substr(1);
    if (kind == "f4") return DType::F32;
    if (kind == "f2") return DType::F16;
    if (kind == "b1") return DType::Bool;
    if (kind == "i4") return DType::I32;
    if (kind == "i1") return DType::I8;
    if (kind == "u1" && as_bool) return DType::Bool;
  }
  invalid(field, "numpy dtype '" + t + "' is not supported; valid: float32, float16, bool, int32");
}

// A numpy array (or anything with __array_interface__) as a view, no copy.
TensorView from_array_interface(const py::handle& obj, const std::string& field, bool writable,
                                bool as_bool) {
  const py::dict ai = obj.attr("__array_interface__");
  const py::tuple data = ai["data"];
  const auto address = data[0].cast<std::uintptr_t>();
  if (writable && data[1].cast<bool>())
    invalid(field, "is a read-only numpy array; the output must be writable");
  const DType dtype = dtype_from_typestr(ai["typestr"].cast<std::string>(), field, as_bool);
  const auto shape = ai["shape"].cast<std::vector<i64>>();
  if (shape.size() > std::size_t(TensorView::kMaxDims))
    invalid(field, "has " + std::to_string(shape.size()) + " dims; at most 6 are supported");
  std::vector<i64> strides(shape.size());
  const i64 es = i64(dtype_size(dtype));
  if (ai.contains("strides") && !ai["strides"].is_none()) {
    const auto bytes = ai["strides"].cast<std::vector<i64>>();
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (bytes[i] % es != 0)
        invalid(field, "has a byte stride that is not a multiple of its element size");
      strides[i] = bytes[i] / es;
    }
  } else {
    i64 s = 1;
    for (std::size_t i = shape.size(); i-- > 0;) {
      strides[i] = s;
      s *= shape[i];
    }
  }
  return TensorView(reinterpret_cast<void*>(address), dtype, shape, strides);
}

std::string device_of(const py::handle& obj) {
  if (py::hasattr(obj, "device")) return py::str(obj.attr("device"));
  return "?";
}

// A tensor argument of the call as a view; the objects it needs stay in `keep`. `as_bool`: the
// tensor is the uint8 view of a bool tensor.
TensorView tensor_arg(const py::handle& obj, const std::string& field, Keep& keep,
                      bool writable = false, bool as_bool = false) {
  if (py::isinstance<py::tuple>(obj)) {
    const auto t = obj.cast<py::tuple>();
    if (t.size() == 2 && py::isinstance<py::str>(t[1]) && t[1].cast<std::string>() == "bool")
      return tensor_arg(t[0], field, keep, writable, true);
  }
  if (py::hasattr(obj, "__array_interface__"))  // numpy: read-only and bool arrays welcome
    return from_array_interface(obj, field, writable, as_bool);
  if (!py::hasattr(obj, "__dlpack__"))
    invalid(field, "expected a torch.Tensor or numpy.ndarray, got " +
                       std::string(py::str(py::type::of(obj))));
  // The device is checked on the DLTensor, not through __dlpack_device__ (4 us per call in
  // PyTorch 1.13, a fifth of a small call); the Python layer refuses non-CPU tensors first.
  py::object capsule = obj.attr("__dlpack__")();
  keep.push_back(capsule);
  keep.push_back(py::reinterpret_borrow<py::object>(obj));
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    invalid(field, "its __dlpack__ capsule was already used");
  }
  DLTensor t = managed->dl_tensor;
  if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost)
    throw Unsupported(field, field + ": lives on device " + device_of(obj) +
                                 "; dattn's Python package computes on CPU tensors only "
                                 "(move it with .cpu())");
  if (as_bool) {
    if (t.dtype.code != kDLUInt || t.dtype.bits != 8)
      invalid(field, "a bool tensor passed as its byte view must be uint8");
    t.dtype.code = 6;  // DLPack 1.x kDLBool, which from_dlpack reads as bool
  }
  try {
    return from_dlpack(t);
  } catch (const InvalidArgument& e) {
    invalid(field, e.what());  // the same message, naming the argument
  }
}

std::optional<TensorView> optional_tensor(const py::dict& d, const char* key,
                                          const std::string& field, Keep& keep) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return tensor_arg(d[key], field, keep);
}

template <class T>
T as(const py::handle& v, const std::string& field, const char* what) {
  try {
    return v.cast<T>();
  } catch (const py::cast_error&) {
    invalid(field, std::string("expected ") + what + ", got " + std::string(py::repr(v)));
  }
}

// An int (or an integer scalar such as numpy's: anything with __index__, not a bool) in int64.
i64 int_value(const py::handle& v, const std::string& field) {
  if (py::isinstance<py::bool_>(v) || !py::hasattr(v, "__index__"))
    invalid(field, "expected an int, got " + std::string(py::repr(v)).substr(0, 80));
  const py::object n = v.attr("__index__")();
  return as<i64>(n, field, "an int within int64 [-2^63, 2^63 - 1]");
}

std::optional<i64> optional_int(const py::dict& d, const char* key, const std::string& field) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return int_value(d[key], field);
}

// A value of the opaque per-backend slot; nullopt for a type no backend can read (ignored,
// as SPEC's extra requires).
// A backend option's value. `strict` (a layer's backend_kwargs): a value of no option type is an
// error naming it; else (the call's opaque extra slot, which carries other backends' keys too)
// it is left out.
std::optional<OptionValue> option_value(const py::handle& v, const std::string& field, Keep& keep,
                                        bool strict) {
  if (py::isinstance<py::bool_>(v)) return OptionValue(v.cast<bool>());
  if (py::isinstance<py::int_>(v)) return OptionValue(v.cast<i64>());
  if (py::isinstance<py::float_>(v)) return OptionValue(v.cast<double>());
  if (py::isinstance<py::str>(v)) return OptionValue(v.cast<std::string>());
  if (py::hasattr(v, "__dlpack__") || py::hasattr(v, "__array_interface__"))
    return OptionValue(tensor_arg(v, field, keep));
  if (py::isinstance<py::tuple>(v) || py::isinstance<py::list>(v)) {
    const auto seq = py::reinterpret_borrow<py::sequence>(v);
    // (uint8 view, "bool"): how the Python layer passes a bool tensor.
    if (py::isinstance<py::tuple>(v) && seq.size() == 2 && py::isinstance<py::str>(seq[1]) &&
        seq[1].cast<std::string>() == "bool")
      return OptionValue(tensor_arg(v, field, keep));
    // A sequence of ints, such as tile = (1, 2, 2): the option's "1,2,2" form.
    std::string joined;
    for (const auto& x : seq) {
      if (py::isinstance<py::bool_>(x) || !py::isinstance<py::int_>(x)) {
        if (!strict) return std::nullopt;
        invalid(field, "a sequence option holds ints only, such as (1, 2, 2); got " +
                           std::string(py::repr(v)));
      }
      joined += (joined.empty() ? "" : ",") + std::to_string(x.cast<i64>());
    }
    return OptionValue(joined);
  }
  if (v.is_none() || !strict) return std::nullopt;
  invalid(field, "expected a bool, int, float, string, sequence of ints or tensor, got " +
                     std::string(py::str(py::type::of(v))));
}

BackendOptions options_from(const py::handle& obj, const std::string& field, Keep& keep) {
  BackendOptions out;
  if (obj.is_none()) return out;
  for (const auto& [k, v] : obj.cast<py::dict>()) {
    const std::string key = py::str(k);
    if (auto value = option_value(v, field + "." + key, keep, true)) out.emplace(key, *value);
  }
  return out;
}

AttentionMetadata metadata_from(const py::handle& obj, Keep& keep) {
  AttentionMetadata m;
  if (obj.is_none()) return m;
  const auto d = obj.cast<py::dict>();
  m.attn_mask = optional_tensor(d, "attn_mask", "attn_mask", keep);
  m.joint_attn_mask = optional_tensor(d, "joint_attn_mask", "joint_attn_mask", keep);
  m.joint_query = optional_tensor(d, "joint_query", "joint_query", keep);
  m.joint_key = optional_tensor(d, "joint_key", "joint_key", keep);
  m.joint_value = optional_tensor(d, "joint_value", "joint_value", keep);
  if (d.contains("joint_strategy") && !d["joint_strategy"].is_none())
    m.joint_strategy = parse_joint_strategy(
        as<std::string>(d["joint_strategy"], "joint_strategy", "'front' or 'rear'"));
  m.q_global_start = optional_int(d, "q_global_start", "q_global_start");
  m.k_global_start = optional_int(d, "k_global_start", "k_global_start");
  if (d.contains("full_attn_spans") && !d["full_attn_spans"].is_none()) {
    FullAttnSpans spans;
    for (const auto& sample : d["full_attn_spans"]) {
      spans.emplace_back();
      for (const auto& span : sample) {
        const auto pair = as<std::pair<i64, i64>>(span, "full_attn_spans", "(start, end) pairs");
        spans.back().push_back(pair);
      }
    }
    m.full_attn_spans = std::move(spans);
  }
  if (d.contains("query_ranges") && !d["query_ranges"].is_none()) {
    std::vector<QueryRange> ranges;
    for (const auto& r : d["query_ranges"]) {
      const auto t = as<std::tuple<i64, i64, i64>>(
          r, "query_ranges", "(local_start, local_end, global_start) triples");
      ranges.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t)});
    }
    m.query_ranges = std::move(ranges);
  }
  if (d.contains("video_layout") && !d["video_layout"].is_none()) {
    const auto vl = d["video_layout"].cast<py::dict>();
    VideoTokenLayout layout;
    layout.prefix_len = optional_int(vl, "prefix_len", "video_layout.prefix_len");
    layout.used_len = optional_int(vl, "used_len", "video_layout.used_len");
    if (vl.contains("latent_grid") && !vl["latent_grid"].is_none())
      layout.latent_grid =
          as<LatentGrid>(vl["latent_grid"], "video_layout.latent_grid", "a (t, h, w) triple");
    if (vl.contains("video_spans"))
      for (const auto& s : vl["video_spans"]) {
        const auto span = s.cast<py::dict>();
        VideoTokenSpan v;
        v.start = optional_int(span, "start", "video_layout.video_spans.start").value_or(0);
        v.latent_grid = as<LatentGrid>(span["latent_grid"], "video_layout.video_spans.latent_grid",
                                       "a (t, h, w) triple");
        v.role = parse_video_role(as<std::string>(span["role"], "video_layout.video_spans.role",
                                                  "'reference' or 'target'"));
        layout.video_spans.push_back(v);
      }
    m.video_layout = std::move(layout);
  }
  if (d.contains("packed_padding") && !d["packed_padding"].is_none()) {
    const auto pp = d["packed_padding"].cast<py::dict>();
    PackedPaddingMetadata p;
    p.q_length = optional_int(pp, "q_length", "packed_padding.q_length").value_or(0);
    p.kv_length = optional_int(pp, "kv_length", "packed_padding.kv_length").value_or(0);
    p.cu_seqlens_q = tensor_arg(pp["cu_seqlens_q"], "packed_padding.cu_seqlens_q", keep);
    p.cu_seqlens_k = tensor_arg(pp["cu_seqlens_k"], "packed_padding.cu_seqlens_k", keep);
    m.packed_padding = p;
  }
  if (d.contains("extra") && !d["extra"].is_none()) {
    for (const auto& [k, v] : d["extra"].cast<py::dict>()) {
      const std::string key = py::str(k);
      const std::string field = key;
      Extra& e = m.extra;
      if (key == "kv_cache_dtype") {
        if (!v.is_none())
          e.kv_cache_dtype = parse_kv_cache_dtype(as<std::string>(v, field, "a string"));
      } else if (key == "cu_seqlens_q" || key == "cu_seqlens_k") {
        if (!v.is_none())
          (key == "cu_seqlens_q" ? e.cu_seqlens_q : e.cu_seqlens_k) = tensor_arg(v, field, keep);
      } else if (key == "max_seqlen_q" || key == "max_seqlen_k" || key == "valid_kv_length") {
        if (v.is_none()) continue;
        const i64 n = int_value(v, field);
        (key == "max_seqlen_q"   ? e.max_seqlen_q
         : key == "max_seqlen_k" ? e.max_seqlen_k
                                 : e.valid_kv_length) = n;
      } else if (key == "attention_mask_mode") {
        if (!v.is_none())
          e.attention_mask_mode = parse_attention_mask_mode(as<std::string>(v, field, "a string"));
      } else if (key == "laser_input_scale") {
        if (!v.is_none()) e.laser_input_scale = as<double>(v, field, "a number");
      } else if (auto value = option_value(v, field, keep, false)) {
        e.backend.emplace(key, *value);  // opaque slot: unknown keys are the backend's business
      }
    }
  }
  return m;
}

AttentionConfig config_from(const py::dict& d) {
  AttentionConfig c;
  Keep unused;  // layer options hold no tensors past construction
  c.num_heads = as<i64>(d["num_heads"], "num_heads", "an int");
  c.head_size = as<i64>(d["head_size"], "head_size", "an int");
  if (d.contains("softmax_scale") && !d["softmax_scale"].is_none())
    c.softmax_scale = as<double>(d["softmax_scale"], "softmax_scale", "a number");
  if (d.contains("causal")) c.causal = as<bool>(d["causal"], "causal", "a bool");
  if (d.contains("num_kv_heads") && !d["num_kv_heads"].is_none())
    c.num_kv_heads = as<i64>(d["num_kv_heads"], "num_kv_heads", "an int");
  if (d.contains("prefix")) c.prefix = as<std::string>(d["prefix"], "prefix", "a string");
  if (d.contains("role") && !d["role"].is_none())
    c.role = parse_attention_role(as<std::string>(d["role"], "role", "'self' or 'cross'"));
  if (d.contains("qkv_layout") && !d["qkv_layout"].is_none())
    c.qkv_layout = parse_qkv_layout(as<std::string>(d["qkv_layout"], "qkv_layout", "a string"));
  if (d.contains("backend") && !d["backend"].is_none())
    c.backend = as<std::string>(d["backend"], "backend", "a string");
  if (d.contains("backend_kwargs"))
    c.backend_options = options_from(d["backend_kwargs"], "backend_kwargs", unused);
  if (!unused.empty())
    invalid("backend_kwargs", "tensors cannot be layer options; pass them per call in extra");
  if (d.contains("kv_cache_dtype") && !d["kv_cache_dtype"].is_none())
    c.kv_cache_dtype =
        parse_kv_cache_dtype(as<std::string>(d["kv_cache_dtype"], "kv_cache_dtype", "a string"));
  if (d.contains("allow_fallback"))
    c.allow_fallback = as<bool>(d["allow_fallback"], "allow_fallback", "a bool");
  return c;
}

// Whether every element of a f32 / bf16 / f16 tensor is finite (exponent bits not all ones),
// scanned over its strides: the drop-in's non_finite rule on the inputs, a memory-speed pass
// instead of torch.isfinite's bool tensor.
template <class Bits>
bool all_finite_bits(const Bits* data, const TensorView& t, int dim, std::int64_t offset,
                     Bits exponent) {
  const std::int64_t n = t.size(dim), stride = t.stride(dim);
  if (dim == t.ndim() - 1) {
    Bits hit = 0;
    if (stride == 1) {
      const Bits* p = data + offset;
      for (std::int64_t i = 0; i < n; ++i) hit |= Bits((p[i] & exponent) == exponent);
    } else {
      for (std::int64_t i = 0; i < n; ++i)
        hit |= Bits((data[offset + i * stride] & exponent) == exponent);
    }
    return hit == 0;
  }
  for (std::int64_t i = 0; i < n; ++i)
    if (!all_finite_bits(data, t, dim + 1, offset + i * stride, exponent)) return false;
  return true;
}

bool all_finite(const TensorView& t) {
  if (t.ndim() == 0) return true;
  for (int d = 0; d < t.ndim(); ++d)
    if (t.size(d) == 0) return true;
  switch (t.dtype()) {
    case DType::F32:
      return all_finite_bits(static_cast<const std::uint32_t*>(t.data()), t, 0, 0,
                             std::uint32_t{0x7F800000u});
    case DType::BF16:
      return all_finite_bits(static_cast<const std::uint16_t*>(t.data()), t, 0, 0,
                             std::uint16_t{0x7F80u});
    case DType::F16:
      return all_finite_bits(static_cast<const std::uint16_t*>(t.data()), t, 0, 0,
                             std::uint16_t{0x7C00u});
    default:
      invalid("tensor", "all_finite takes f32, bf16 or f16 tensors");
  }
}

class Layer {
 public:
  explicit Layer(const py::dict& config) : layer_(config_from(config)) {}

  // Runs one call into `out` (and `lse`); returns the name of the backend that ran it.
  // `threads` > 0: the call's OpenMP threads (the torch adapter passes torch.get_num_threads()).
  std::string forward_into(const py::handle& q, const py::handle& k, const py::handle& v,
                           const py::handle& metadata, const py::handle& out, const py::handle& lse,
                           int threads) const {
    Keep keep;
    const TensorView qv = tensor_arg(q, "query", keep), kv = tensor_arg(k, "key", keep),
                     vv = tensor_arg(v, "value", keep);
    const TensorView ov = tensor_arg(out, "out", keep, true);
    std::optional<TensorView> lv;
    if (!lse.is_none()) lv = tensor_arg(lse, "lse", keep, true);
    const AttentionMetadata meta = metadata_from(metadata, keep);
    const Backend* ran = nullptr;
    {
      py::gil_scoped_release release;
      const ScopedThreads scoped(threads);
      ran = &layer_.forward_into(qv, kv, vv, meta, ov, lv);
    }
    return ran->name();
  }

  void forward_paged(const py::dict& call, const py::handle& cache_obj) const;

  // The block selection VIDEO_SPARSE makes for this call (the layer's options, the call's extra
  // over them), without computing the attention: {"shape": (B|1, Hq|1, query blocks, key
  // blocks), "block_map": bytes (one 0/1 byte per block pair, row-major in that shape),
  // "sparsity": fraction of the used (query, key) row pairs not computed, "video_blocks": the
  // sparse blocks of the tiling}. What dattn.diffusers reuses across denoising steps.
  py::dict video_sparse_selection(const py::handle& q, const py::handle& k, const py::handle& v,
                                  const py::handle& metadata, const py::handle& out,
                                  int threads) const {
    Keep keep;
    const TensorView qv = tensor_arg(q, "query", keep), kv = tensor_arg(k, "key", keep),
                     vv = tensor_arg(v, "value", keep);
    const TensorView ov = tensor_arg(out, "out", keep, true);
    const AttentionMetadata meta = metadata_from(metadata, keep);
    std::string bytes;
    std::array<i64, 4> shape{};
    double sparsity = 0;
    i64 video_blocks = 0;
    {
      py::gil_scoped_release release;
      const ScopedThreads scoped(threads);
      const VideoSparseSelection s = dattn::video_sparse_selection(
          layer_.config(), AttentionInputs{qv, kv, vv, &meta, ov, {}});
      const BlockMap& m = s.map;
      shape = {m.batch_stride == 0 ? 1 : m.batch, m.head_stride == 0 ? 1 : m.heads, m.query_blocks,
               m.key_blocks};
      bytes.assign(std::size_t(shape[0] * shape[1] * shape[2] * shape[3]), '\0');
      for (i64 b = 0; b < shape[0]; ++b)
        for (i64 h = 0; h < shape[1]; ++h)
          for (i64 qb = 0; qb < shape[2]; ++qb) {
            char* row = bytes.data() + ((b * shape[1] + h) * shape[2] + qb) * shape[3];
            for (const std::int32_t kb : m.selected(b, h, qb)) row[kb] = 1;
          }
      sparsity = m.sparsity(s.tiling.queries, s.tiling.keys);
      video_blocks = s.tiling.queries.video_blocks();
    }
    py::dict d;
    d["shape"] = py::make_tuple(shape[0], shape[1], shape[2], shape[3]);
    d["block_map"] = py::bytes(bytes);
    d["sparsity"] = sparsity;
    d["video_blocks"] = video_blocks;
    return d;
  }

  std::string backend_name() const { return layer_.backend().name(); }
  std::string last_engine() const { return layer_.last_engine(); }
  std::string selection() const { return layer_.selection().to_string(); }
  i64 num_kv_heads() const { return layer_.impl().config().num_kv_heads; }
  double softmax_scale() const { return layer_.impl().config().softmax_scale; }

 private:
  Attention layer_;
};

// A page pool whose pages numpy can see (as arrays that keep the pool alive).
class Pool {
 public:
  explicit Pool(const py::dict& d) : pool_(config(d)) {}

  static PagePoolConfig config(const py::dict& d) {
    PagePoolConfig c;
    c.layers = optional_int(d, "layers", "layers").value_or(1);
    c.num_blocks = optional_int(d, "num_blocks", "num_blocks").value_or(0);
    c.block_size = optional_int(d, "block_size", "block_size").value_or(16);
    c.kv_heads = optional_int(d, "kv_heads", "kv_heads").value_or(1);
    c.head_size = optional_int(d, "head_size", "head_size").value_or(64);
    c.value_head_size = optional_int(d, "value_head_size", "value_head_size").value_or(0);
    if (d.contains("dtype") && !d["dtype"].is_none()) {
      const auto name = as<std::string>(d["dtype"], "dtype", "a dtype name");
      const auto dt = parse_dtype(name);
      if (!dt) invalid("dtype", "'" + name + "' is not a dtype; valid: f32, bf16, f16, int8, fp8");
      c.dtype = *dt;
    }
    if (d.contains("layout") && !d["layout"].is_none()) {
      const auto l = as<std::string>(d["layout"], "layout", "a string");
      if (l == "layer_outermost")
        c.layout = CacheLayout::layer_outermost;
      else if (l == "block_outermost")
        c.layout = CacheLayout::block_outermost;
      else
        invalid("layout", "'" + l + "' is not valid; valid: layer_outermost, block_outermost");
    }
    return c;
  }

  PagePool& get() { return pool_; }
  const PagePool& get() const { return pool_; }

 private:
  PagePool pool_;
};

void Layer::forward_paged(const py::dict& call, const py::handle& cache_obj) const {
  Keep keep;
  PagedAttentionCall c;
  c.q = tensor_arg(call["query"], "query", keep);
  c.k_new = tensor_arg(call["key"], "key", keep);
  c.v_new = tensor_arg(call["value"], "value", keep);
  c.out = tensor_arg(call["out"], "out", keep, true);
  if (call.contains("lse") && !call["lse"].is_none())
    c.lse = tensor_arg(call["lse"], "lse", keep, true);
  const Pool& pool = cache_obj.cast<const Pool&>();
  c.cache = pool.get().layer(optional_int(call, "layer", "layer").value_or(0));
  for (const auto& r : call["rows"]) {
    const auto row = r.cast<py::dict>();
    PagedRow pr;
    pr.query_len = optional_int(row, "query_len", "rows.query_len").value_or(0);
    pr.seq_len = optional_int(row, "seq_len", "rows.seq_len").value_or(0);
    pr.kv_start_pos = optional_int(row, "kv_start_pos", "rows.kv_start_pos").value_or(0);
    pr.block_table =
        as<std::vector<std::int32_t>>(row["block_table"], "rows.block_table", "a list of page ids");
    c.rows.push_back(std::move(pr));
  }
  c.softmax_scale = call.contains("softmax_scale") && !call["softmax_scale"].is_none()
                        ? as<double>(call["softmax_scale"], "softmax_scale", "a number")
                        : layer_.impl().config().softmax_scale;
  if (call.contains("causal")) c.causal = as<bool>(call["causal"], "causal", "a bool");
  if (call.contains("full_attn_spans") && !call["full_attn_spans"].is_none())
    for (const auto& span : call["full_attn_spans"])
      c.full_attn_spans.push_back(
          as<std::pair<i64, i64>>(span, "full_attn_spans", "(start, end) pairs"));
  const int threads = static_cast<int>(optional_int(call, "threads", "threads").value_or(0));
  py::gil_scoped_release release;
  const ScopedThreads scoped{threads};
  layer_.forward_paged(c);
}

// One capability's value: a bool, a tuple of platform names (None = any), a list of head sizes
// or dtype names, or a dict from platform name to kv cache dtype names.
py::object capability_python(const CapabilityValue& value) {
  struct ToPython {
    py::object operator()(bool b) const { return py::bool_(b); }
    py::object operator()(const std::optional<std::vector<Platform>>& platforms) const {
      if (!platforms) return py::none();
      py::list l;
      for (Platform p : *platforms) l.append(std::string(platform_name(p)));
      return py::tuple(l);
    }
    py::object operator()(const std::vector<i64>& sizes) const { return py::cast(sizes); }
    py::object operator()(const std::vector<DType>& dtypes) const {
      py::list l;
      for (DType t : dtypes) l.append(std::string(dtype_name(t)));
      return l;
    }
    py::object operator()(const std::map<Platform, std::vector<KvCacheDtype>>& table) const {
      py::dict d;
      for (const auto& [platform, dtypes] : table) {
        py::list names;
        for (KvCacheDtype k : dtypes) names.append(std::string(kv_cache_dtype_name(k)));
        d[py::str(std::string(platform_name(platform)))] = names;
      }
      return d;
    }
  };
  return std::visit(ToPython{}, value);
}

// Identity, availability and every capability of capability_table() under its name, plus
// "dtypes": {"f32": bool, "bf16": bool, "f16": bool} (the Python layer's supports_dtype).
py::dict backend_info(const Backend& b) {
  py::dict d;
  d["name"] = b.name();
  d["description"] = b.description();
  if (const auto names = b.option_names())
    d["options"] = py::cast(*names);
  else
    d["options"] = py::none();
  d["priority"] = b.priority();
  for (const Capability& c : capability_table())
    d[py::str(std::string(c.name))] = capability_python(c.read(b, nullptr));
  py::dict dtypes;
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    dtypes[py::str(std::string(dtype_name(t)))] = b.supports_dtype(t);
  d["dtypes"] = dtypes;
  std::string unavailable;
  try {
    b.validate_available();
  } catch (const std::exception& e) {
    unavailable = e.what();
  }
  d["available"] = unavailable.empty();
  d["unavailable_reason"] = unavailable;
  return d;
}

// Raises the Python class dattn.errors.<name> with the C++ message and the field.
void raise_python(const char* name, const Error& e) {
  const py::module_ errors = py::module_::import("dattn.errors");
  const py::object cls = errors.attr(name);
  const py::object exc = cls(std::string(e.what()));
  exc.attr("field") = e.field();
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

}  // namespace
// ---- result memory: the outputs the Python package allocates ----

// One result's memory (dattn::allocate_result: from 64 KiB on a mapping of the process's, never
// a block of the C heap that the small objects layers keep could pin), owned by this object
// until it is freed. numpy reads it through the buffer protocol (np.frombuffer keeps it alive).
class ResultBuffer {
 public:
  explicit ResultBuffer(std::size_t bytes) : bytes_(bytes), data_(allocate_result(bytes)) {}
  ~ResultBuffer() { release_result(data_); }
  ResultBuffer(const ResultBuffer&) = delete;
  ResultBuffer& operator=(const ResultBuffer&) = delete;
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::size_t bytes_;
  void* data_;
};

// A DLPack capsule ("dltensor") of a new compact tensor of `shape` and `dtype` (f32, f16, bf16)
// in result memory, which the capsule's consumer (torch.from_dlpack) frees through its deleter:
// no Python object is involved once it is handed over.
py::capsule result_capsule(const std::vector<i64>& shape, const std::string& dtype) {
  struct Owned {
    DLManagedTensor managed{};
    DLPackShapeStorage storage;
    void* data = nullptr;
  };
  DType dt = DType::F32;
  if (dtype == "f32")
    dt = DType::F32;
  else if (dtype == "f16")
    dt = DType::F16;
  else if (dtype == "bf16")
    dt = DType::BF16;
  else
    invalid("dtype", "'" + dtype + "' is not valid; valid: f32, f16, bf16");
  const TensorView shaped(nullptr, dt, shape);  // the shape's checks and compact strides
  auto owned = std::make_unique<Owned>();
  owned->data =
      allocate_result(std::max<std::size_t>(std::size_t(shaped.numel()) * dtype_size(dt), 1));
  owned->managed.dl_tensor =
      to_dlpack(TensorView(owned->data, dt, shaped.shape(), shaped.strides()), owned->storage);
  owned->managed.manager_ctx = owned.get();
  owned->managed.deleter = [](DLManagedTensor* self) {
    auto* o = static_cast<Owned*>(self->manager_ctx);
    release_result(o->data);
    delete o;
  };
  // Not consumed (the capsule still named "dltensor" when it dies): free it here.
  PyObject* cap = PyCapsule_New(&owned->managed, "dltensor", [](PyObject* c) {
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      managed->deleter(managed);
    }
  });
  if (cap == nullptr) {
    release_result(owned->data);
    throw py::error_already_set();
  }
  owned.release();
  return py::reinterpret_steal<py::capsule>(cap);
}

}  // namespace dattn::python

PYBIND11_MODULE(_core, m) {
  using namespace dattn;
  using namespace dattn::python;
  m.doc() = "dattn's compiled core; use the dattn package";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      raise_python("InvalidArgument", e);
    } catch (const Unsupported& e) {
      raise_python("Unsupported", e);
    } catch (const NotAvailable& e) {
      raise_python("NotAvailable", e);
    } catch (const Error& e) {
      raise_python("Error", e);
    }
  });

  py::class_<ResultBuffer>(m, "ResultBuffer", py::buffer_protocol())
      .def(py::init<std::size_t>())
      .def_property_readonly("nbytes", &ResultBuffer::bytes)
      .def_buffer([](ResultBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {py::ssize_t(b.bytes())}, {py::ssize_t(1)});
      });
  m.def("result_capsule", &result_capsule, py::arg("shape"), py::arg("dtype"));
  m.def("empty_cache", [] { return empty_cache(); });
  m.def("memory_stats", [] {
    const MemoryStats s = memory_stats();
    py::dict d;
    d["idle_bytes"] = s.idle_bytes;
    d["idle_buffers"] = s.idle_buffers;
    d["idle_limit"] = s.idle_limit;
    d["in_use_bytes"] = s.in_use_bytes;
    d["calls_in_flight"] = s.calls_in_flight;
    d["live_layers"] = s.live_layers;
    return d;
  });

  py::class_<Layer>(m, "Layer")
      .def(py::init<const py::dict&>())
      .def("forward_into", &Layer::forward_into, py::arg("q"), py::arg("k"), py::arg("v"),
           py::arg("metadata"), py::arg("out"), py::arg("lse"), py::arg("threads") = 0)
      .def("forward_paged", &Layer::forward_paged)
      .def("video_sparse_selection", &Layer::video_sparse_selection, py::arg("q"), py::arg("k"),
           py::arg("v"), py::arg("metadata"), py::arg("out"), py::arg("threads") = 0)
      .def_property_readonly("backend_name", &Layer::backend_name)
      .def_property_readonly("last_engine", &Layer::last_engine)
      .def_property_readonly("selection", &Layer::selection)
      .def_property_readonly("num_kv_heads", &Layer::num_kv_heads)
      .def_property_readonly("softmax_scale", &Layer::softmax_scale);

  py::class_<Pool>(m, "PagePool")
      .def(py::init<const py::dict&>())
      .def("allocate", [](Pool& p, std::int64_t n) { return p.get().allocate(n); })
      .def("free",
           [](Pool& p, const std::vector<std::int32_t>& ids) {
             p.get().free(std::span<const std::int32_t>(ids.data(), ids.size()));
           })
      .def_property_readonly("capacity", [](const Pool& p) { return p.get().capacity(); })
      .def_property_readonly("free_pages", [](const Pool& p) { return p.get().free_pages(); })
      .def("is_allocated", [](const Pool& p, std::int32_t id) { return p.get().is_allocated(id); })
      .def_property_readonly("nbytes", [](const Pool& p) { return p.get().bytes(); })
      .def("read", [](const Pool& p, std::int64_t layer, bool value, std::int64_t page,
                      std::int64_t slot, std::int64_t head) {
        // One dequantized page row, for inspection and tests.
        const PagedKvCache c = p.get().layer(layer);
        const TensorView& pages = value ? c.v_pages : c.k_pages;
        const auto& scales = value ? c.v_scales : c.k_scales;
        if (page < 0 || page >= pages.size(0) || slot < 0 || slot >= pages.size(1) || head < 0 ||
            head >= pages.size(2))
          throw InvalidArgument("page", "page: (page, slot, head) is outside the pool");
        std::vector<float> row(std::size_t(pages.size(3)));
        for (std::int64_t e = 0; e < pages.size(3); ++e)
          row[std::size_t(e)] = paged_value(pages, scales, page, slot, head, e);
        return row;
      });

  m.def("cpu_info", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["vendor"] = f.vendor;
    d["brand"] = f.brand;
    d["logical_cpus"] = f.logical_cpus;
    d["l2_bytes"] = f.l2_bytes;  // one core's L2 as the OS reports it; 0 when unknown
    d["features"] = f.names();   // under DATTN_CPU_FEATURES, if set
    d["sve_bits"] = f.sve_bits;  // SVE's vector length in bits for this process (0 without)
    d["detected_features"] = detected_cpu_features().names();
    const char* mask = std::getenv("DATTN_CPU_FEATURES");  // as `dattn info` reports it
    d["feature_mask"] = mask != nullptr && std::string_view(mask).find_first_not_of(
                                               " \t\n\v\f\r") != std::string_view::npos
                            ? py::cast(std::string(mask))
                            : py::none();
    // The never-silently-slow rule (dattn/engines.hpp): why automatic calls run far below this
    // CPU, or None.
    const std::optional<SimdShortfall> shortfall = simd_shortfall();
    d["far_below_cpu"] = shortfall ? py::cast(shortfall->message) : py::none();
    d["max_threads"] = kMaxThreads;
    d["default_threads"] = default_threads();  // what a call uses (the one thread bound)
    d["affinity_cpus"] = affinity_cpus();      // the CPUs this process may run on
    return d;
  });
  m.def(
      "measure_peak_gflops",
      [](int threads, double seconds) {
        PeakGflops p;
        {
          py::gil_scoped_release release;
          p = measure_peak_gflops(threads, seconds);
        }
        py::dict d;
        d["f32_fma"] = p.f32_fma;
        d["bf16_dot"] = p.bf16_dot ? py::cast(*p.bf16_dot) : py::none();
        d["amx_bf16"] = p.amx_bf16 ? py::cast(*p.amx_bf16) : py::none();
        d["bf16_dot_unavailable"] = p.bf16_dot ? py::none() : py::cast(p.bf16_dot_unavailable);
        d["amx_bf16_unavailable"] = p.amx_bf16 ? py::none() : py::cast(p.amx_bf16_unavailable);
        d["int8_dot"] = p.int8_dot ? py::cast(*p.int8_dot) : py::none();
        d["int8_dot_isa"] = py::cast(p.int8_dot_isa);
        d["int8_dot_unavailable"] = p.int8_dot ? py::none() : py::cast(p.int8_dot_unavailable);
        d["int16_dot"] = p.int16_dot ? py::cast(*p.int16_dot) : py::none();
        d["int16_dot_isa"] = py::cast(p.int16_dot_isa);
        d["int16_dot_unavailable"] = p.int16_dot ? py::none() : py::cast(p.int16_dot_unavailable);
        d["amx_int8"] = p.amx_int8 ? py::cast(*p.amx_int8) : py::none();
        d["amx_int8_unavailable"] = p.amx_int8 ? py::none() : py::cast(p.amx_int8_unavailable);
        d["threads"] = p.threads;
        d["isa"] = p.isa;
        return d;
      },
      py::arg("threads") = 0, py::arg("seconds") = 0.2);
  m.def(
      "all_finite",
      [](const py::handle& t) {
        Keep keep;
        const TensorView v = tensor_arg(t, "tensor", keep);
        py::gil_scoped_release release;
        return all_finite(v);
      },
      py::arg("tensor"));
  m.def("flash_engines", [] {
    py::list out;
    for (const EngineInfo& e : flash_engines()) {
      py::dict d;
      d["name"] = e.name;
      d["rank"] = e.rank;
      d["compute_dtype"] = e.compute_dtype;
      d["emulated"] = e.emulated;
      d["unavailable_reason"] = e.unavailable_reason ? py::cast(*e.unavailable_reason) : py::none();
      out.append(d);
    }
    return out;
  });
  m.def("backends", [] {
    py::list out;
    for (const auto& b : Registry::global().all()) out.append(backend_info(*b));
    return out;
  });
}
