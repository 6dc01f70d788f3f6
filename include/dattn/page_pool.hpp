// Owning page pools for paged KV (docs/semantics.md, "Paged KV"): a multi-layer cache in either
// physical layout with a page allocator, and the two ways diffusion models use it: a cached
// conditioning prefix reused by every denoising step, and the chunk window of autoregressive video
// models.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dattn/dtype.hpp"
#include "dattn/paged.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

enum class CacheLayout : std::uint8_t {
  layer_outermost,  // [layers][blocks][block_size, Hkv, D]
  block_outermost,  // [blocks][layers][block_size, Hkv, D]: one block's pages of all layers
                    // together
};

struct PagePoolConfig {
  std::int64_t layers = 1;
  std::int64_t num_blocks = 0;
  std::int64_t block_size = 16;
  std::int64_t kv_heads = 1;
  std::int64_t head_size = 64;
  std::int64_t value_head_size = 0;  // 0 = head_size
  DType dtype = DType::F32;          // f32, bf16, f16, int8 or fp8_e4m3
  CacheLayout layout = CacheLayout::layer_outermost;
};

// K and V pages of every layer, allocated together. Page ids are shared by all layers (a
// sequence's block table is valid in every layer).
class PagePool {
 public:
  // Throws InvalidArgument naming the config field that is invalid.
  explicit PagePool(const PagePoolConfig& config);

  const PagePoolConfig& config() const { return config_; }
  // Layer `layer`'s pool as views with the layout's strides (scales included for int8/fp8).
  PagedKvCache layer(std::int64_t layer) const;

  // `pages` free page ids, lowest first; throws Unsupported("capacity") and takes nothing
  // when fewer are free.
  std::vector<std::int32_t> allocate(std::int64_t pages);
  // Returns pages to the pool (their scales reset); InvalidArgument for an id that is out of
  // range or not allocated, and then nothing is freed.
  void free(std::span<const std::int32_t> pages);
  std::int64_t capacity() const { return config_.num_blocks; }
  std::int64_t free_pages() const { return static_cast<std::int64_t>(free_.size()); }
  bool is_allocated(std::int32_t page) const;
  // Bytes of pages and scales.
  std::size_t bytes() const;

 private:
  PagePoolConfig config_;
  Tensor k_, v_, k_scales_, v_scales_;
  std::vector<std::int32_t> free_;  // kept sorted descending: back() is the lowest id
  std::vector<char> allocated_;
};

// A diffusion call with a long conditioning prefix (text, reference images) in front of the
// target rows. Step 0 writes K/V of [prefix | target] and every row attends all of them; each
// later denoising step rewrites only the target rows and reuses the cached prefix pages.
class PrefixCache {
 public:
  PrefixCache(PagePool& pool, std::int64_t prefix_len, std::int64_t target_len);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Step 0: query_len = prefix + target rows, written from position 0.
  PagedRow first_step() const;
  // Later steps: the target rows only, written from position prefix_len.
  PagedRow next_step() const;
  const std::vector<std::int32_t>& pages() const { return table_; }

 private:
  PagePool& pool_;
  std::int64_t prefix_len_, target_len_;
  std::vector<std::int32_t> table_;
};

// The chunk window of autoregressive video models: the video is produced chunk by chunk
// (chunk_tokens rows each, a multiple of the block size); a new chunk attends the first `sink`
// chunks, the last `window` committed chunks and itself. Each chunk is denoised in several
// passes that write its K/V into scratch pages (overwritten by every pass); commit() keeps the
// last pass's pages as the chunk's and frees the chunks that left the window (sinks stay).
class ChunkWindow {
 public:
  ChunkWindow(PagePool& pool, std::int64_t chunk_tokens, std::int64_t window, std::int64_t sink);
  ~ChunkWindow();
  ChunkWindow(const ChunkWindow&) = delete;
  ChunkWindow& operator=(const ChunkWindow&) = delete;

  // The paged row of a denoising pass of the next chunk: its keys are the visible chunks then
  // the new one (scratch pages are taken on the first pass of a chunk).
  PagedRow pass();
  // Keeps the pending chunk; frees what left the window.
  void commit();
  // Drops the pending chunk's scratch pages.
  void discard();

  // Indices of the committed chunks the next chunk sees, in order.
  std::vector<std::int64_t> visible_chunks() const;
  // Committed chunks so far, and the pages each one still holds (empty once freed).
  std::int64_t chunks() const { return static_cast<std::int64_t>(pages_.size()); }
  const std::vector<std::int32_t>& chunk_pages(std::int64_t chunk) const;

 private:
  PagePool& pool_;
  std::int64_t chunk_tokens_, window_, sink_, pages_per_chunk_;
  std::vector<std::vector<std::int32_t>> pages_;  // per committed chunk
  std::vector<std::int32_t> scratch_;
};

}  // namespace dattn
