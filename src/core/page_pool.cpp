#include "dattn/page_pool.hpp"

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <string>

#include "dattn/errors.hpp"

namespace dattn {

namespace {

using i64 = std::int64_t;

[[noreturn]] void invalid(const std::string& field, const std::string& what) {
  throw InvalidArgument(field, field + ": " + what);
}

}  // namespace

PagePool::PagePool(const PagePoolConfig& config) : config_(config) {
  PagePoolConfig& c = config_;
  if (c.value_head_size == 0) c.value_head_size = c.head_size;
  const std::array<std::pair<const char*, i64>, 6> sizes{{{"layers", c.layers},
                                                          {"num_blocks", c.num_blocks},
                                                          {"block_size", c.block_size},
                                                          {"kv_heads", c.kv_heads},
                                                          {"head_size", c.head_size},
                                                          {"value_head_size", c.value_head_size}}};
  for (const auto& [name, value] : sizes)
    if (value <= 0 || value > (i64(1) << 24))
      invalid(name, std::to_string(value) + " is not valid; valid: 1 to 2^24");
  if (c.num_blocks > std::numeric_limits<std::int32_t>::max())
    invalid("num_blocks", "page ids are int32");
  if (!is_float_input_dtype(c.dtype) && !is_quantized_page_dtype(c.dtype))
    invalid("dtype", std::string(dtype_name(c.dtype)) +
                         " is not valid; valid: f32, bf16, f16, int8, fp8_e4m3");
  k_ = Tensor::zeros({c.layers * c.num_blocks * c.block_size * c.kv_heads * c.head_size}, c.dtype);
  v_ = Tensor::zeros({c.layers * c.num_blocks * c.block_size * c.kv_heads * c.value_head_size},
                     c.dtype);
  if (is_quantized_page_dtype(c.dtype)) {
    k_scales_ = Tensor::zeros({c.layers, c.num_blocks, c.kv_heads}, DType::F32);
    v_scales_ = Tensor::zeros({c.layers, c.num_blocks, c.kv_heads}, DType::F32);
  }
  free_.resize(std::size_t(c.num_blocks));
  for (i64 n = 0; n < c.num_blocks; ++n)
    free_[std::size_t(n)] = static_cast<std::int32_t>(c.num_blocks - 1 - n);
  allocated_.assign(std::size_t(c.num_blocks), 0);
}

PagedKvCache PagePool::layer(i64 layer) const {
  const PagePoolConfig& c = config_;
  if (layer < 0 || layer >= c.layers)
    invalid("layer", std::to_string(layer) + " is not in [0, " + std::to_string(c.layers) + ")");
  const auto view = [&](const Tensor& t, i64 width) {
    const i64 page = c.block_size * c.kv_heads * width;
    const bool block_outer = c.layout == CacheLayout::block_outermost;
    const std::array<i64, 4> shape{c.num_blocks, c.block_size, c.kv_heads, width};
    const std::array<i64, 4> strides{block_outer ? c.layers * page : page, c.kv_heads * width,
                                     width, 1};
    const i64 first = block_outer ? layer * page : layer * c.num_blocks * page;
    auto* base = static_cast<std::byte*>(t.data()) + first * i64(dtype_size(c.dtype));
    return TensorView(base, c.dtype, shape, strides);
  };
  PagedKvCache cache(view(k_, c.head_size), view(v_, c.value_head_size));
  if (is_quantized_page_dtype(c.dtype)) {
    const auto scales = [&](const Tensor& t) {
      return TensorView(t.data_as<float>() + layer * c.num_blocks * c.kv_heads, DType::F32,
                        {c.num_blocks, c.kv_heads});
    };
    cache.k_scales = scales(k_scales_);
    cache.v_scales = scales(v_scales_);
  }
  return cache;
}

std::vector<std::int32_t> PagePool::allocate(i64 pages) {
  if (pages < 0) invalid("pages", "cannot allocate " + std::to_string(pages) + " pages");
  if (pages > free_pages())
    throw Unsupported("capacity", "capacity: " + std::to_string(pages) + " pages asked, " +
                                      std::to_string(free_pages()) + " of " +
                                      std::to_string(capacity()) + " free");
  std::vector<std::int32_t> out;
  for (i64 n = 0; n < pages; ++n) {
    out.push_back(free_.back());
    free_.pop_back();
    allocated_[std::size_t(out.back())] = 1;
  }
  return out;
}

void PagePool::free(std::span<const std::int32_t> pages) {
  std::vector<char> seen(allocated_.size(), 0);
  for (const std::int32_t id : pages) {
    if (id < 0 || id >= capacity() || !allocated_[std::size_t(id)] || seen[std::size_t(id)])
      invalid("pages", "page " + std::to_string(id) + " is not an allocated page of this pool");
    seen[std::size_t(id)] = 1;
  }
  for (const std::int32_t id : pages) {
    allocated_[std::size_t(id)] = 0;
    free_.push_back(id);
    if (is_quantized_page_dtype(config_.dtype))
      for (i64 l = 0; l < config_.layers; ++l)
        for (i64 h = 0; h < config_.kv_heads; ++h) {
          const i64 at = (l * config_.num_blocks + id) * config_.kv_heads + h;
          k_scales_.data_as<float>()[at] = 0.0f;
          v_scales_.data_as<float>()[at] = 0.0f;
        }
  }
  std::sort(free_.begin(), free_.end(), std::greater<>());
}

bool PagePool::is_allocated(std::int32_t page) const {
  return page >= 0 && page < capacity() && allocated_[std::size_t(page)] != 0;
}

std::size_t PagePool::bytes() const {
  const bool scaled = is_quantized_page_dtype(config_.dtype);
  return k_.nbytes() + v_.nbytes() + (scaled ? k_scales_.nbytes() + v_scales_.nbytes() : 0);
}

// ---- PrefixCache ----

PrefixCache::PrefixCache(PagePool& pool, i64 prefix_len, i64 target_len)
    : pool_(pool), prefix_len_(prefix_len), target_len_(target_len) {
  if (prefix_len < 0 || target_len < 0)
    invalid("prefix_len", "prefix and target lengths must be >= 0");
  const i64 bs = pool.config().block_size;
  table_ = pool.allocate((prefix_len + target_len + bs - 1) / bs);
}

PrefixCache::~PrefixCache() {
  pool_.free(table_);
}

PagedRow PrefixCache::first_step() const {
  return {prefix_len_ + target_len_, prefix_len_ + target_len_, 0, table_};
}

PagedRow PrefixCache::next_step() const {
  return {target_len_, prefix_len_ + target_len_, prefix_len_, table_};
}

// ---- ChunkWindow ----

ChunkWindow::ChunkWindow(PagePool& pool, i64 chunk_tokens, i64 window, i64 sink)
    : pool_(pool), chunk_tokens_(chunk_tokens), window_(window), sink_(sink) {
  const i64 bs = pool.config().block_size;
  if (chunk_tokens <= 0 || chunk_tokens % bs != 0)
    invalid("chunk_tokens", std::to_string(chunk_tokens) +
                                " is not valid; valid: a positive multiple of the block size " +
                                std::to_string(bs));
  if (window < 0) invalid("window", "window must be >= 0");
  if (sink < 0) invalid("sink", "sink must be >= 0");
  pages_per_chunk_ = chunk_tokens / bs;
}

ChunkWindow::~ChunkWindow() {
  discard();
  for (const auto& p : pages_)
    if (!p.empty()) pool_.free(p);
}

std::vector<i64> ChunkWindow::visible_chunks() const {
  std::vector<i64> out;
  const i64 n = chunks();
  for (i64 c = 0; c < n; ++c)
    if (c < sink_ || c >= n - window_) out.push_back(c);
  return out;
}

const std::vector<std::int32_t>& ChunkWindow::chunk_pages(i64 chunk) const {
  if (chunk < 0 || chunk >= chunks())
    invalid("chunk", std::to_string(chunk) + " is not a committed chunk");
  return pages_[std::size_t(chunk)];
}

PagedRow ChunkWindow::pass() {
  if (scratch_.empty()) scratch_ = pool_.allocate(pages_per_chunk_);
  PagedRow row;
  for (const i64 c : visible_chunks())
    row.block_table.insert(row.block_table.end(), pages_[std::size_t(c)].begin(),
                           pages_[std::size_t(c)].end());
  const i64 before = static_cast<i64>(row.block_table.size()) * pool_.config().block_size;
  row.block_table.insert(row.block_table.end(), scratch_.begin(), scratch_.end());
  row.query_len = chunk_tokens_;
  row.kv_start_pos = before;
  row.seq_len = before + chunk_tokens_;
  return row;
}

void ChunkWindow::commit() {
  if (scratch_.empty()) invalid("commit", "no pending chunk: run pass() first");
  pages_.push_back(std::move(scratch_));
  scratch_.clear();
  // Chunks that no later chunk will see: neither a sink nor among the last `window`.
  const i64 n = chunks();
  for (i64 c = sink_; c < n - window_; ++c)
    if (!pages_[std::size_t(c)].empty()) {
      pool_.free(pages_[std::size_t(c)]);
      pages_[std::size_t(c)].clear();
    }
}

void ChunkWindow::discard() {
  if (!scratch_.empty()) pool_.free(scratch_);
  scratch_.clear();
}

}  // namespace dattn
