#include "dattn/paged.hpp"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "dattn/errors.hpp"

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
  for (const auto& [t, name] : {std::pair{&kp, "cache.k_pages"}, std::pair{&vp, "cache.v_pages"}})
    if (!is_float_input_dtype(t->dtype()))
      throw Unsupported(name, std::string(name) + ": page dtype " +
                                  std::string(dtype_name(t->dtype())) +
                                  " is not supported here; valid: f32, bf16, f16");

  std::int64_t total = 0;
  for (const PagedRow& r : call.rows) total += std::max<std::int64_t>(r.query_len, 0);
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

  std::unordered_set<std::int64_t> written;
  for (std::size_t i = 0; i < call.rows.size(); ++i) {
    const PagedRow& r = call.rows[i];
    const std::string row = "rows[" + std::to_string(i) + "]";
    if (r.query_len < 0 || r.seq_len < 0 || r.kv_start_pos < 0 ||
        r.kv_start_pos + r.query_len > r.seq_len)
      invalid(row, "{query_len " + std::to_string(r.query_len) + ", seq_len " +
                       std::to_string(r.seq_len) + ", kv_start_pos " +
                       std::to_string(r.kv_start_pos) +
                       "} needs non-negative values and kv_start_pos + query_len <= seq_len");
    if (call.causal && r.kv_start_pos + r.query_len != r.seq_len)
      invalid(row, "a causal row must end at seq_len (kv_start_pos + query_len = " +
                       std::to_string(r.kv_start_pos + r.query_len) +
                       ", seq_len = " + std::to_string(r.seq_len) + ")");
    const std::int64_t pages = (r.seq_len + bs - 1) / bs;
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

}  // namespace dattn
