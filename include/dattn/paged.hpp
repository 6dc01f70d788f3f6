// Paged KV (SPEC §10): page pools addressed through block tables.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dattn/tensor.hpp"

namespace dattn {

// One layer's page pool. k_pages [num_blocks, block_size, Hkv, D], v_pages
// [num_blocks, block_size, Hkv, Dv]; any strides, so a layer of a block-outermost multi-layer
// cache (runtime block stride) is as valid as a layer-outermost one.
struct PagedKvCache {
  TensorView k_pages;
  TensorView v_pages;
  std::int64_t block_size() const { return k_pages.ndim() == 4 ? k_pages.size(1) : 0; }
  std::int64_t num_blocks() const { return k_pages.ndim() == 4 ? k_pages.size(0) : 0; }
};

// One sequence in a paged call: its new rows [kv_start_pos, kv_start_pos + query_len) are
// written into the cache, then its queries attend keys [0, seq_len) through block_table.
struct PagedRow {
  std::int64_t query_len = 0;
  std::int64_t seq_len = 0;
  std::int64_t kv_start_pos = 0;
  std::vector<std::int32_t> block_table;
};

// Flat slot id of token position `pos` under `block_table` (SPEC §10):
// table[pos / block_size] * block_size + pos % block_size.
std::int64_t paged_slot(const std::vector<std::int32_t>& block_table, std::int64_t block_size,
                        std::int64_t pos);

struct PagedAttentionCall;

// Checks a paged call before anything is written (SPEC §10, §13): shapes and dtypes against
// the layer (num_heads, num_kv_heads, head_size), rows with kv_start_pos + query_len <=
// seq_len, tables long enough for seq_len with page ids inside the pool, no slot written twice,
// causal rows ending at seq_len. Throws InvalidArgument naming the field.
void validate_paged_call(const PagedAttentionCall& call, std::int64_t num_heads,
                         std::int64_t num_kv_heads, std::int64_t head_size);

// A batch of paged rows. Rows are packed along the token dim in order:
// q [T, Hq, D], k_new [T, Hkv, D], v_new [T, Hkv, Dv], out [T, Hq, Dv], lse f32 [Hq, T],
// T = sum of query_len.
struct PagedAttentionCall {
  TensorView q, k_new, v_new, out;
  std::optional<TensorView> lse;
  PagedKvCache cache;
  std::vector<PagedRow> rows;
  double softmax_scale = 1.0;
  bool causal = false;  // bottom-right inside each row
};

}  // namespace dattn
