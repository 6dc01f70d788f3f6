#include "dattn/paged.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <unordered_set>

#include "core/kv_quant.hpp"
#include "core/tensor_checks.hpp"
#include "dattn/errors.hpp"
#include "dattn/metadata.hpp"

namespace dattn {

namespace {

[[noreturn]] void invalid(const std::string& field, const std::string& msg) {
  throw InvalidArgument(field, field + ": " + msg);
}

}  // namespace

std::int64_t paged_slot(const std::vector<std::int32_t>& block_table, std::int64_t block_size,
                        std::int64_t pos) {
  if (block_size <= 0 || pos < 0 ||
      pos / block_size >= static_cast<std::int64_t>(block_table.size()))
    invalid("block_table", "position " + std::to_string(pos) + " is outside a table of " +
                               std::to_string(block_table.size()) + " pages of " +
                               std::to_string(block_size));
  return std::int64_t{block_table[std::size_t(pos / block_size)]} * block_size + pos % block_size;
}

void validate_paged_call(const PagedAttentionCall& call, std::int64_t num_heads,
                         std::int64_t num_kv_heads, std::int64_t head_size) {
  const TensorView& kp = call.cache.k_pages;
  const TensorView& vp = call.cache.v_pages;
  // Memory first (docs/semantics.md, "Tensors"): every view addresses real memory; the outputs
  // (out, lse and the pages, which this call writes) alias neither themselves nor what is read.
  const std::vector<std::pair<const TensorView*, const char*>> read{
      {&call.q, "q"}, {&call.k_new, "k_new"}, {&call.v_new, "v_new"}};
  std::vector<std::pair<const TensorView*, const char*>> written_views{
      {&call.out, "out"}, {&kp, "cache.k_pages"}, {&vp, "cache.v_pages"}};
  if (call.lse) written_views.emplace_back(&*call.lse, "lse");
  if (call.cache.k_scales) written_views.emplace_back(&*call.cache.k_scales, "cache.k_scales");
  if (call.cache.v_scales) written_views.emplace_back(&*call.cache.v_scales, "cache.v_scales");
  for (const auto& [t, name] : read) detail::check_view_memory(*t, name);
  for (const auto& [t, name] : written_views) {
    detail::check_view_memory(*t, name);
    detail::check_output_internal_overlap(*t, name);
  }
  for (std::size_t i = 0; i < written_views.size(); ++i) {
    const auto& [t, name] = written_views[i];
    for (const auto& [in, in_name] : read)
      detail::check_output_overlap(*t, name, *in, in_name, t == &call.out && in == &call.q);
    for (std::size_t j = 0; j < i; ++j)
      detail::check_output_overlap(*t, name, *written_views[j].first, written_views[j].second);
  }
  if (kp.ndim() != 4 || vp.ndim() != 4)
    invalid("cache.k_pages", "pages must be [num_blocks, block_size, Hkv, D]; got " +
                                 kp.describe() + " and " + vp.describe());
  const std::int64_t nb = kp.size(0), bs = kp.size(1);
  if (bs <= 0) invalid("cache.k_pages", "block_size must be positive, got " + std::to_string(bs));
  if (kp.size(2) != num_kv_heads || kp.size(3) != head_size)
    invalid("cache.k_pages", "expected [*, *, " + std::to_string(num_kv_heads) + ", " +
                                 std::to_string(head_size) + "], got " + kp.describe());
  if (vp.size(0) != nb || vp.size(1) != bs || vp.size(2) != num_kv_heads)
    invalid("cache.v_pages",
            "must match k_pages in blocks, block size and heads; got " + vp.describe());
  const std::int64_t dv = vp.size(3);
  const auto check_pages = [&](const TensorView& t, const std::optional<TensorView>& scales,
                               const char* name, const char* scales_name) {
    if (!is_float_input_dtype(t.dtype()) && !is_quantized_page_dtype(t.dtype()))
      invalid(name, std::string("page dtype ") + std::string(dtype_name(t.dtype())) +
                        " is not valid; valid: f32, bf16, f16, int8, fp8_e4m3");
    if (!is_quantized_page_dtype(t.dtype())) return;
    if (!scales || scales->dtype() != DType::F32 || scales->ndim() != 2 || scales->size(0) != nb ||
        scales->size(1) != num_kv_heads || scales->platform() != t.platform())
      invalid(scales_name, std::string(dtype_name(t.dtype())) + " pages need f32 scales [" +
                               std::to_string(nb) + ", " + std::to_string(num_kv_heads) +
                               "] next to them; got " +
                               (scales ? scales->describe() : std::string("none")));
  };
  check_pages(kp, call.cache.k_scales, "cache.k_pages", "cache.k_scales");
  check_pages(vp, call.cache.v_scales, "cache.v_pages", "cache.v_scales");

  std::int64_t total = 0;
  for (std::size_t i = 0; i < call.rows.size(); ++i)
    if (__builtin_add_overflow(total, std::max<std::int64_t>(call.rows[i].query_len, 0), &total))
      invalid("rows[" + std::to_string(i) + "]", "query_len " +
                                                     std::to_string(call.rows[i].query_len) +
                                                     " makes the rows' total overflow");
  const auto check_rows = [&](const TensorView& t, const char* name, std::int64_t heads,
                              std::int64_t dim) {
    if (t.ndim() != 3 || t.size(0) != total || t.size(1) != heads || t.size(2) != dim)
      invalid(name, "expected [" + std::to_string(total) + ", " + std::to_string(heads) + ", " +
                        std::to_string(dim) + "] (rows packed in order), got " + t.describe());
    if (!is_float_input_dtype(t.dtype()))
      invalid(name, "dtype " + std::string(dtype_name(t.dtype())) +
                        " is not valid; valid: f32, bf16, f16");
    if (t.platform() != Platform::cpu && t.platform() != call.q.platform())
      invalid(name, "lives on a different platform than q");
  };
  check_rows(call.q, "q", num_heads, head_size);
  check_rows(call.k_new, "k_new", num_kv_heads, head_size);
  check_rows(call.v_new, "v_new", num_kv_heads, dv);
  check_rows(call.out, "out", num_heads, dv);
  if (call.lse) {
    const TensorView& l = *call.lse;
    if (l.dtype() != DType::F32 || l.ndim() != 2 || l.size(0) != num_heads || l.size(1) != total)
      invalid("lse", "expected f32 [" + std::to_string(num_heads) + ", " + std::to_string(total) +
                         "], got " + l.describe());
  }

  if (!call.full_attn_spans.empty() && !call.causal)
    invalid("full_attn_spans", "full spans refine a causal call; set causal");
  for (std::size_t i = 0; i < call.full_attn_spans.size(); ++i) {
    const auto [a, e] = call.full_attn_spans[i];
    if (a < 0 || a >= e || (i > 0 && a < call.full_attn_spans[i - 1].second))
      invalid("full_attn_spans", "span " + std::to_string(i) + " [" + std::to_string(a) + ", " +
                                     std::to_string(e) +
                                     ") is negative, empty, unsorted or overlapping");
    if (e > kMaxPosition)
      invalid("full_attn_spans", "span " + std::to_string(i) + " [" + std::to_string(a) + ", " +
                                     std::to_string(e) +
                                     ") ends past position 2^62 (kMaxPosition)");
  }
  std::unordered_set<std::int64_t> written;
  for (std::size_t i = 0; i < call.rows.size(); ++i) {
    const PagedRow& r = call.rows[i];
    const std::string row = "rows[" + std::to_string(i) + "]";
    // seq_len - query_len cannot overflow once both are non-negative.
    if (r.query_len < 0 || r.seq_len < 0 || r.kv_start_pos < 0 || r.seq_len > kMaxPosition ||
        r.kv_start_pos > r.seq_len - r.query_len)
      invalid(row, "{query_len " + std::to_string(r.query_len) + ", seq_len " +
                       std::to_string(r.seq_len) + ", kv_start_pos " +
                       std::to_string(r.kv_start_pos) +
                       "} needs non-negative values, kv_start_pos + query_len <= seq_len and "
                       "seq_len <= 2^62 (kMaxPosition)");
    if (call.causal && r.kv_start_pos + r.query_len != r.seq_len)
      invalid(row, "a causal row must end at seq_len (kv_start_pos + query_len = " +
                       std::to_string(r.kv_start_pos + r.query_len) +
                       ", seq_len = " + std::to_string(r.seq_len) + ")");
    const std::int64_t pages = r.seq_len / bs + (r.seq_len % bs != 0 ? 1 : 0);
    if (static_cast<std::int64_t>(r.block_table.size()) < pages)
      invalid(row + ".block_table", "has " + std::to_string(r.block_table.size()) +
                                        " pages but seq_len " + std::to_string(r.seq_len) +
                                        " needs " + std::to_string(pages));
    for (std::int64_t pg = 0; pg < pages; ++pg) {
      const std::int32_t id = r.block_table[std::size_t(pg)];
      if (id < 0 || id >= nb)
        invalid(row + ".block_table", "page id " + std::to_string(id) +
                                          " is outside the pool [0, " + std::to_string(nb) + ")");
    }
    for (std::int64_t pos = r.kv_start_pos; pos < r.kv_start_pos + r.query_len; ++pos)
      if (!written.insert(paged_slot(r.block_table, bs, pos)).second)
        invalid(row, "writes slot " + std::to_string(paged_slot(r.block_table, bs, pos)) +
                         " that another row of this call also writes");
  }
}

bool is_quantized_page_dtype(DType dtype) {
  return dtype == DType::I8 || dtype == DType::FP8_E4M3;
}

namespace {

std::int64_t page_offset(const TensorView& t, std::int64_t page, std::int64_t slot,
                         std::int64_t head, std::int64_t e) {
  return page * t.stride(0) + slot * t.stride(1) + head * t.stride(2) + e * t.stride(3);
}

float& scale_at(const TensorView& scales, std::int64_t page, std::int64_t head) {
  return static_cast<float*>(scales.data())[page * scales.stride(0) + head * scales.stride(1)];
}

}  // namespace

float paged_value(const TensorView& pages, const std::optional<TensorView>& scales,
                  std::int64_t page, std::int64_t slot, std::int64_t head, std::int64_t e) {
  const float v = load_as_f32(pages.data(), pages.dtype(), page_offset(pages, page, slot, head, e));
  return is_quantized_page_dtype(pages.dtype()) ? v * scale_at(*scales, page, head) : v;
}

void write_paged_kv(const PagedAttentionCall& call) {
  const std::int64_t bs = call.cache.k_pages.size(1);
  // int8/fp8 pages share one scale per (page, head): an inf or NaN would poison its finite
  // neighbours, so it is refused before anything is written.
  for (const auto& [src, pages, field] : {std::tuple{&call.k_new, &call.cache.k_pages, "k_new"},
                                          std::tuple{&call.v_new, &call.cache.v_pages, "v_new"}})
    if (is_quantized_page_dtype(pages->dtype()))
      detail::require_finite_for_quantization(
          src->unsqueezed(0), pages->dtype() == DType::I8 ? KvCacheDtype::int8 : KvCacheDtype::fp8,
          field);
  // (row of the call, page, slot) of every new token. Every buffer is allocated before the
  // first write (docs/semantics.md, "Faults"): running out of memory leaves the pages as they
  // were, never with new K and old V.
  struct Target {
    std::int64_t t, page, slot;
  };
  std::vector<Target> targets;
  std::int64_t t0 = 0;
  for (const PagedRow& r : call.rows) {
    for (std::int64_t n = 0; n < r.query_len; ++n) {
      const std::int64_t s = paged_slot(r.block_table, bs, r.kv_start_pos + n);
      targets.push_back({t0 + n, s / bs, s % bs});
    }
    t0 += r.query_len;
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> touched;  // (page, head) of quantized pages
  std::vector<float> need;
  touched.reserve(targets.size() * std::size_t(call.cache.k_pages.size(2)));
  need.reserve(touched.capacity());
  for (const auto& [src, pages, scales] :
       {std::tuple{&call.k_new, &call.cache.k_pages, &call.cache.k_scales},
        std::tuple{&call.v_new, &call.cache.v_pages, &call.cache.v_scales}}) {
    const std::int64_t heads = pages->size(2), width = pages->size(3);
    // (clang 14 cannot capture structured bindings, hence `source`)
    const auto value = [&, source = src](std::int64_t t, std::int64_t h, std::int64_t e) {
      return load_as_f32(source->data(), source->dtype(),
                         t * source->stride(0) + h * source->stride(1) + e * source->stride(2));
    };
    const bool quantized = is_quantized_page_dtype(pages->dtype());
    if (quantized) {
      // Grow each touched (page, head) scale to cover its new values; re-encode what it held.
      touched.clear();  // within the capacity reserved above: no allocation
      need.clear();
      for (const Target& tg : targets)
        for (std::int64_t h = 0; h < heads; ++h) {
          float absmax = 0.0f;
          for (std::int64_t e = 0; e < width; ++e)
            absmax = std::max(absmax, std::fabs(value(tg.t, h, e)));
          const auto key = std::pair{tg.page, h};
          const auto it = std::find(touched.begin(), touched.end(), key);
          if (it == touched.end()) {
            touched.push_back(key);
            need.push_back(absmax);
          } else {
            float& n = need[std::size_t(it - touched.begin())];
            n = std::max(n, absmax);
          }
        }
      for (std::size_t i = 0; i < touched.size(); ++i) {
        const auto [page, h] = touched[i];
        float& scale = scale_at(**scales, page, h);
        const float wanted = detail::kv_quant_scale(
            need[i], pages->dtype() == DType::I8 ? KvCacheDtype::int8 : KvCacheDtype::fp8);
        if (scale > 0.0f && wanted <= scale) continue;
        if (scale > 0.0f)
          for (std::int64_t slot = 0; slot < bs; ++slot)
            for (std::int64_t e = 0; e < width; ++e) {
              const std::int64_t at = page_offset(*pages, page, slot, h, e);
              const float old = load_as_f32(pages->data(), pages->dtype(), at) * scale;
              store_from_f32(pages->data(), pages->dtype(), at, old / wanted);
            }
        scale = wanted;
      }
    }
    for (const Target& tg : targets)
      for (std::int64_t h = 0; h < heads; ++h) {
        const float inv = quantized ? 1.0f / scale_at(**scales, tg.page, h) : 1.0f;
        for (std::int64_t e = 0; e < width; ++e)
          store_from_f32(pages->data(), pages->dtype(), page_offset(*pages, tg.page, tg.slot, h, e),
                         quantized ? value(tg.t, h, e) * inv : value(tg.t, h, e));
      }
  }
}

}  // namespace dattn
