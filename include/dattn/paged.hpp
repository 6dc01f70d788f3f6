// Paged KV (docs/semantics.md, "Paged KV"): page pools addressed through block tables.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dattn/tensor.hpp"

namespace dattn {

// One layer's page pool. k_pages [num_blocks, block_size, Hkv, D], v_pages
// [num_blocks, block_size, Hkv, Dv]; any strides, so a layer of a block-outermost multi-layer
// cache (runtime block stride) is as valid as a layer-outermost one. Pages are f32, bf16, f16,
// or quantized: int8 (symmetric) or fp8 e4m3, whose value is code x scale with one f32 scale
// per (page, KV head) in k_scales / v_scales [num_blocks, Hkv] (0 = nothing written yet).
struct PagedKvCache {
  PagedKvCache() = default;
  PagedKvCache(TensorView k, TensorView v, std::optional<TensorView> k_scale = std::nullopt,
               std::optional<TensorView> v_scale = std::nullopt)
      : k_pages(std::move(k)),
        v_pages(std::move(v)),
        k_scales(std::move(k_scale)),
        v_scales(std::move(v_scale)) {}
  TensorView k_pages;
  TensorView v_pages;
  std::optional<TensorView> k_scales;
  std::optional<TensorView> v_scales;
  std::int64_t block_size() const { return k_pages.ndim() == 4 ? k_pages.size(1) : 0; }
  std::int64_t num_blocks() const { return k_pages.ndim() == 4 ? k_pages.size(0) : 0; }
};

// Whether pages of `dtype` hold quantized codes (int8, fp8 e4m3) that need scales.
bool is_quantized_page_dtype(DType dtype);

// One sequence in a paged call: its new rows [kv_start_pos, kv_start_pos + query_len) are
// written into the cache, then its queries attend keys [0, seq_len) through block_table.
struct PagedRow {
  std::int64_t query_len = 0;
  std::int64_t seq_len = 0;
  std::int64_t kv_start_pos = 0;
  std::vector<std::int32_t> block_table;
};

// Flat slot id of token position `pos` under `block_table` (docs/semantics.md, "Paged KV"):
// table[pos / block_size] * block_size + pos % block_size.
std::int64_t paged_slot(const std::vector<std::int32_t>& block_table, std::int64_t block_size,
                        std::int64_t pos);

struct PagedAttentionCall;

// Checks a paged call before anything is written (docs/semantics.md, "Paged KV" and "Errors"):
// shapes and dtypes against the layer (num_heads, num_kv_heads, head_size), rows with kv_start_pos
// + query_len <= seq_len, tables long enough for seq_len with page ids inside the pool, no slot
// written twice, causal rows ending at seq_len. Throws InvalidArgument naming the field.
void validate_paged_call(const PagedAttentionCall& call, std::int64_t num_heads,
                         std::int64_t num_kv_heads, std::int64_t head_size);

// Writes the new K/V rows of a validated call into their slots. Into quantized pages: per
// (page, KV head) the scale becomes large enough for the new values (absmax / 127 for int8,
// absmax / 448 for fp8); when it grows, the page's existing codes are re-encoded with it.
void write_paged_kv(const PagedAttentionCall& call);

// The value at (page, slot, head, element) of a pool, dequantized with `scales` when the pages
// are quantized.
float paged_value(const TensorView& pages, const std::optional<TensorView>& scales,
                  std::int64_t page, std::int64_t slot, std::int64_t head, std::int64_t e);

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
  // Piecewise causal/full attention (docs/semantics.md, "Piecewise spans and query ranges") on a
  // causal call: a query at a position inside span [a, e) sees every key < e that the row has (a
  // span may reach past a row's seq_len, as when a long sequence is filled in chunks). Positions of
  // each row's sequence; sorted, disjoint, the same for every row.
  std::vector<std::pair<std::int64_t, std::int64_t>> full_attn_spans;
};

}  // namespace dattn
