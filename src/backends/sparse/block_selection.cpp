// VIDEO_SPARSE options and block selection (docs/semantics.md, "Video token layout and
// VIDEO_SPARSE"): sliding tile window, top-k by mean-pooled scores, explicit maps.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>

#include "core/prepare_call.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "dattn/video_sparse.hpp"

namespace dattn {

namespace {

using i64 = std::int64_t;

[[noreturn]] void invalid(const std::string& field, const std::string& what) {
  throw InvalidArgument(field, field + ": " + what);
}

// "a,b,c" or a single integer n (meaning n,n,n) -> three positive sizes.
std::array<i64, 3> triple(const OptionValue& v, const std::string& key) {
  if (const auto* n = std::get_if<i64>(&v)) {
    if (*n <= 0) invalid(key, key + " = " + std::to_string(*n) + " must be positive");
    return {*n, *n, *n};
  }
  const auto* s = std::get_if<std::string>(&v);
  if (s == nullptr) invalid(key, "expected \"t,h,w\" or an integer");
  std::array<i64, 3> out{};
  std::istringstream in(*s);
  std::string part;
  int n = 0;
  while (std::getline(in, part, ',')) {
    std::size_t used = 0;
    long long value = 0;
    try {
      value = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (n >= 3 || used != part.size() || value <= 0 || value > 4096)
      invalid(key, "'" + *s + "' is not valid; valid: three positive sizes \"t,h,w\" up to 4096");
    out[std::size_t(n++)] = value;
  }
  if (n != 3) invalid(key, "'" + *s + "' is not valid; valid: three positive sizes \"t,h,w\"");
  return out;
}

i64 integer(const OptionValue& v, const std::string& key, i64 lo, i64 hi) {
  const auto* n = std::get_if<i64>(&v);
  if (n == nullptr || *n < lo || *n > hi)
    invalid(key, key + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "]");
  return *n;
}

TensorView tensor(const OptionValue& v, const std::string& key) {
  const auto* t = std::get_if<TensorView>(&v);
  if (t == nullptr) invalid(key, key + " must be a tensor");
  if (t->platform() != Platform::cpu) invalid(key, key + " must be in host memory");
  return *t;
}

void read(VideoSparseOptions& o, const BackendOptions& m) {
  for (const auto& [key, value] : m) {
    if (key == "selection") {
      const auto* s = std::get_if<std::string>(&value);
      if (s == nullptr) invalid(key, "selection must be a string");
      o.selection = parse_block_selection(*s);
    } else if (key == "tile") {
      o.tile = triple(value, key);
    } else if (key == "window") {
      o.window = triple(value, key);
    } else if (key == "dense_block") {
      o.dense_block = integer(value, key, 1, i64(1) << 20);
    } else if (key == "topk") {
      o.topk = integer(value, key, 1, std::numeric_limits<std::int32_t>::max());
    } else if (key == "sparsity") {
      double s = 0;
      if (const auto* d = std::get_if<double>(&value))
        s = *d;
      else if (const auto* n = std::get_if<i64>(&value))
        s = double(*n);
      else
        invalid(key, "sparsity must be a number in [0, 1)");
      if (!(s >= 0.0 && s < 1.0))
        invalid(key, "sparsity = " + std::to_string(s) + " is not valid; valid: [0, 1)");
      o.sparsity = s;
      o.topk.reset();
    } else if (key == "gate") {
      o.gate = tensor(value, key);
    } else if (key == "block_map") {
      o.block_map = tensor(value, key);
    } else if (key == "block_indices") {
      o.block_indices = tensor(value, key);
    } else if (key == "block_counts") {
      o.block_counts = tensor(value, key);
    }
  }
}

// Checks that `t` is [B|1, H|1, rows, cols...] of `dtype`; returns (batch stride, head stride)
// in elements (0 where broadcast).
std::array<i64, 2> check_map_tensor(const TensorView& t, const std::string& key, DType dtype,
                                    int rank, const AttentionProblem& p, i64 rows, i64 cols) {
  std::ostringstream want;
  want << "[" << p.batch << "|1, " << p.hq << "|1, " << rows;
  if (rank == 4) want << ", " << (cols >= 0 ? std::to_string(cols) : std::string("K"));
  want << "] " << dtype_name(dtype);
  const bool ok = t.ndim() == rank && t.dtype() == dtype &&
                  (t.size(0) == p.batch || t.size(0) == 1) &&
                  (t.size(1) == p.hq || t.size(1) == 1) && t.size(2) == rows &&
                  (rank == 3 || cols < 0 || t.size(3) == cols);
  if (!ok) invalid(key, "got " + t.describe() + "; valid: " + want.str());
  return {t.size(0) == 1 ? 0 : t.stride(0), t.size(1) == 1 ? 0 : t.stride(1)};
}

// Appends row `qb`'s blocks from `keep` (size kblocks, sorted by construction).
void push_row(BlockMap& m, const std::vector<char>& keep) {
  for (std::size_t kb = 0; kb < keep.size(); ++kb)
    if (keep[kb]) m.indices.push_back(static_cast<std::int32_t>(kb));
  m.offsets.push_back(static_cast<i64>(m.indices.size()));
}

// An empty map with one CSR row per (batch, query head, query block).
BlockMap per_head_map(const AttentionProblem& p, i64 nq, i64 nk) {
  BlockMap m;
  m.batch = p.batch;
  m.heads = p.hq;
  m.query_blocks = nq;
  m.key_blocks = nk;
  m.batch_stride = p.hq * nq;
  m.head_stride = nq;
  return m;
}

BlockMap explicit_map(const AttentionProblem& p, const CallTiling& t, const VideoSparseOptions& o) {
  const i64 nq = static_cast<i64>(t.queries.blocks().size());
  const i64 nk = static_cast<i64>(t.keys.blocks().size());
  BlockMap m = per_head_map(p, nq, nk);
  std::vector<char> keep(static_cast<std::size_t>(nk));
  const auto empty_row = [&](i64 b, i64 h, i64 qb) {
    invalid(o.block_map ? "block_map" : "block_indices",
            "query block " + std::to_string(qb) + " (batch " + std::to_string(b) + ", head " +
                std::to_string(h) + ") selects no key block; every query block needs one");
  };
  if (o.block_map) {
    const TensorView& bm = *o.block_map;
    const auto [sb, sh] = check_map_tensor(bm, "block_map", DType::Bool, 4, p, nq, nk);
    const auto* bytes = static_cast<const std::uint8_t*>(bm.data());
    for (i64 b = 0; b < p.batch; ++b)
      for (i64 h = 0; h < p.hq; ++h)
        for (i64 qb = 0; qb < nq; ++qb) {
          bool any = false;
          for (i64 kb = 0; kb < nk; ++kb) {
            keep[std::size_t(kb)] = bytes[b * sb + h * sh + qb * bm.stride(2) + kb * bm.stride(3)];
            any = any || keep[std::size_t(kb)];
          }
          if (!any && nk > 0) empty_row(b, h, qb);
          push_row(m, keep);
        }
    return m;
  }
  if (!o.block_indices || !o.block_counts)
    invalid(o.block_indices ? "block_counts" : "block_indices",
            "selection \"explicit\" needs block_map, or block_indices with block_counts");
  const TensorView& bi = *o.block_indices;
  const TensorView& bc = *o.block_counts;
  const auto [ib, ih] = check_map_tensor(bi, "block_indices", DType::I32, 4, p, nq, -1);
  const auto [cb, ch] = check_map_tensor(bc, "block_counts", DType::I32, 3, p, nq, -1);
  const i64 width = bi.size(3);
  const auto* idx = static_cast<const std::int32_t*>(bi.data());
  const auto* cnt = static_cast<const std::int32_t*>(bc.data());
  for (i64 b = 0; b < p.batch; ++b)
    for (i64 h = 0; h < p.hq; ++h)
      for (i64 qb = 0; qb < nq; ++qb) {
        const i64 count = cnt[b * cb + h * ch + qb * bc.stride(2)];
        if (count < 0 || count > width)
          invalid("block_counts", "count " + std::to_string(count) + " of query block " +
                                      std::to_string(qb) + " is not in [0, " +
                                      std::to_string(width) + "]");
        std::fill(keep.begin(), keep.end(), 0);
        for (i64 n = 0; n < count; ++n) {
          const i64 kb = idx[b * ib + h * ih + qb * bi.stride(2) + n * bi.stride(3)];
          if (kb < 0 || kb >= nk)
            invalid("block_indices", "index " + std::to_string(kb) + " of query block " +
                                         std::to_string(qb) + " is not a key block; valid: [0, " +
                                         std::to_string(nk) + ")");
          keep[std::size_t(kb)] = 1;
        }
        if (count == 0 && nk > 0) empty_row(b, h, qb);
        push_row(m, keep);
      }
  return m;
}

BlockMap topk_map(const AttentionProblem& p, const CallTiling& t, const VideoSparseOptions& o,
                  const PooledBlocks& pooled) {
  const auto& qblocks = t.queries.blocks();
  const auto& kblocks = t.keys.blocks();
  const i64 nq = static_cast<i64>(qblocks.size()), nk = static_cast<i64>(kblocks.size());
  std::vector<i64> video;
  for (i64 kb = 0; kb < nk; ++kb)
    if (!kblocks[std::size_t(kb)].dense) video.push_back(kb);
  const i64 k =
      std::min<i64>(o.topk_for(static_cast<i64>(video.size())), static_cast<i64>(video.size()));
  BlockMap m = per_head_map(p, nq, nk);
  // Each row's selection is independent: score them in parallel, then build the CSR.
  const i64 rows = p.batch * p.hq * nq, group = p.group_size();
  std::vector<std::int32_t> chosen(std::size_t(rows * k));
  // Each thread's score and rank buffers, allocated before the region: no exception (a
  // std::bad_alloc) may leave an OpenMP region.
  const int threads = std::max(p.threads, 1);
  std::vector<std::vector<float>> scores(std::size_t(threads), std::vector<float>(video.size()));
  std::vector<std::vector<i64>> ranks(std::size_t(threads), std::vector<i64>(video.size()));
  // The pooled video keys of each (batch, KV head) transposed, [D][video blocks]: a row's
  // scores are then D sweeps of FMAs along contiguous blocks (vectorised across blocks), not
  // one short horizontal reduction per block.
  const std::size_t nv = video.size();
  std::vector<float> kt(std::size_t(p.batch * p.hkv * p.d) * nv);
  for (i64 bh = 0; bh < p.batch * p.hkv; ++bh)
    for (std::size_t n = 0; n < nv; ++n) {
      const float* pk = pooled.k.data() + (bh * nk + video[n]) * p.d;
      float* dst = kt.data() + std::size_t(bh * p.d) * nv + n;
      for (i64 e = 0; e < p.d; ++e) dst[std::size_t(e) * nv] = pk[e];
    }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float>& score = scores[std::size_t(omp_get_thread_num())];
    std::vector<i64>& rank = ranks[std::size_t(omp_get_thread_num())];
#pragma omp for schedule(static)
    for (i64 row = 0; row < rows; ++row) {
      const i64 b = row / (p.hq * nq), h = row / nq % p.hq, qb = row % nq;
      if (qblocks[std::size_t(qb)].dense || k == 0) continue;
      const float* pq = pooled.q.data() + row * p.d;
      const float* kh = kt.data() + std::size_t((b * p.hkv + h / group) * p.d) * nv;
      float* out = score.data();
      std::fill(out, out + nv, 0.0f);
      for (i64 e = 0; e < p.d; ++e) {
        const float qe = pq[e];
        const float* ke = kh + std::size_t(e) * nv;
#pragma omp simd
        for (std::size_t n = 0; n < nv; ++n) out[n] += qe * ke[n];
      }
      for (std::size_t n = 0; n < nv; ++n)
        if (pooled.k_rows[std::size_t(b * nk + video[n])] == 0)
          out[n] = -std::numeric_limits<float>::infinity();
      // Highest score first, ties by block index; a NaN score (NaN or inf in the pooled Q or
      // K) ranks below every number. Each candidate as one integer key in that order (the
      // score's bits made monotone, NaN lowest, then the inverted index), so the k largest
      // are a selection over integers (nth_element, linear on average) and the ranking is
      // strict: the same blocks, in the same order, as sorting by the rule.
      for (std::size_t n = 0; n < video.size(); ++n) {
        const float sc = score[n];
        std::uint32_t bits = 0;
        if (!std::isnan(sc)) {
          const float v = sc == 0.0f ? 0.0f : sc;  // -0 and +0 are one score (a tie)
          std::memcpy(&bits, &v, sizeof bits);
          bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // monotone in sc
          bits = std::max<std::uint32_t>(bits, 1u);                    // above every NaN
        }
        rank[n] = static_cast<i64>((std::uint64_t(bits) << 32) |
                                   (0xFFFFFFFFu - static_cast<std::uint32_t>(n)));
      }
      const auto greater = [](i64 a, i64 c) {
        return static_cast<std::uint64_t>(a) > static_cast<std::uint64_t>(c);
      };
      std::nth_element(rank.begin(), rank.begin() + (k - 1), rank.end(), greater);
      std::sort(rank.begin(), rank.begin() + k, greater);
      for (i64 n = 0; n < k; ++n) {
        const std::uint32_t index =
            0xFFFFFFFFu -
            static_cast<std::uint32_t>(static_cast<std::uint64_t>(rank[std::size_t(n)]));
        chosen[std::size_t(row * k + n)] = static_cast<std::int32_t>(video[index]);
      }
    }
  }
  std::vector<char> keep(static_cast<std::size_t>(nk));
  for (i64 row = 0; row < rows; ++row) {
    const i64 qb = row % nq;
    if (qblocks[std::size_t(qb)].dense || video.empty()) {
      std::fill(keep.begin(), keep.end(), 1);
    } else {
      for (i64 kb = 0; kb < nk; ++kb) keep[std::size_t(kb)] = kblocks[std::size_t(kb)].dense;
      for (i64 n = 0; n < k; ++n) keep[std::size_t(chosen[std::size_t(row * k + n)])] = 1;
    }
    push_row(m, keep);
  }
  return m;
}

// Adds row `row` of head `head` of `t` (a RowRef) to `acc`.
void accumulate(const RowRef& r, i64 b, i64 head, i64 width, float* acc) {
  const TensorView& t = *r.view;
  const i64 base = b * t.stride(0) + r.row * t.stride(1) + head * t.stride(2);
  if (t.dtype() == DType::F32 && t.stride(3) == 1) {
    const float* src = static_cast<const float*>(t.data()) + base;
    for (i64 e = 0; e < width; ++e) acc[e] += src[e];
    return;
  }
  for (i64 e = 0; e < width; ++e)
    acc[e] += load_as_f32(t.data(), t.dtype(), base + e * t.stride(3));
}

}  // namespace

BlockSelection parse_block_selection(std::string_view s) {
  if (names_equal(s, "topk")) return BlockSelection::topk;
  if (names_equal(s, "sliding_tile")) return BlockSelection::sliding_tile;
  if (names_equal(s, "explicit")) return BlockSelection::explicit_map;
  throw InvalidArgument("selection", "selection = '" + std::string(s) +
                                         "' is not valid; valid: topk, sliding_tile, explicit");
}

std::string_view block_selection_name(BlockSelection s) {
  switch (s) {
    case BlockSelection::topk:
      return "topk";
    case BlockSelection::sliding_tile:
      return "sliding_tile";
    case BlockSelection::explicit_map:
      return "explicit";
  }
  return "?";
}

VideoSparseOptions VideoSparseOptions::from(const BackendOptions& construction,
                                            const BackendOptions* call) {
  VideoSparseOptions o;
  read(o, construction);
  if (call != nullptr) read(o, *call);
  return o;
}

i64 VideoSparseOptions::topk_for(i64 video_blocks) const {
  if (topk) return *topk;
  return std::max<i64>(1, std::llround((1.0 - sparsity) * double(video_blocks)));
}

double BlockMap::sparsity(const VideoTiling& queries, const VideoTiling& keys) const {
  const double total = double(queries.used_len()) * double(keys.used_len()) * double(batch * heads);
  if (total == 0) return 0.0;
  double computed = 0;
  for (i64 b = 0; b < batch; ++b)
    for (i64 h = 0; h < heads; ++h)
      for (i64 qb = 0; qb < query_blocks; ++qb) {
        i64 keys_seen = 0;
        for (std::int32_t kb : selected(b, h, qb))
          keys_seen += keys.blocks()[std::size_t(kb)].size();
        computed += double(queries.blocks()[std::size_t(qb)].size()) * double(keys_seen);
      }
  return 1.0 - computed / total;
}

BlockMap sliding_tile_map(const VideoTiling& queries, const VideoTiling& keys,
                          const std::array<i64, 3>& window) {
  const auto& qblocks = queries.blocks();
  const auto& kblocks = keys.blocks();
  const i64 nk = static_cast<i64>(kblocks.size());
  BlockMap m;
  m.query_blocks = static_cast<i64>(qblocks.size());
  m.key_blocks = nk;
  std::vector<char> keep(static_cast<std::size_t>(nk));
  const bool same = &queries == &keys || queries.order() == keys.order();
  for (const VideoBlock& q : qblocks) {
    if (q.dense || !same) {
      std::fill(keep.begin(), keep.end(), 1);
      push_row(m, keep);
      continue;
    }
    for (i64 kb = 0; kb < nk; ++kb) keep[std::size_t(kb)] = kblocks[std::size_t(kb)].dense;
    const VideoGrid& g = keys.grids()[std::size_t(q.grid)];
    std::array<i64, 3> lo{}, hi{};
    for (std::size_t a = 0; a < 3; ++a) {
      const i64 n = g.tiles[a], w = std::min(window[a], n);
      lo[a] = std::clamp<i64>(q.tile[a] - w / 2, 0, n - w);
      hi[a] = lo[a] + w;
    }
    for (i64 ct = lo[0]; ct < hi[0]; ++ct)
      for (i64 ch = lo[1]; ch < hi[1]; ++ch)
        for (i64 cw = lo[2]; cw < hi[2]; ++cw)
          keep[std::size_t(g.first_block + (ct * g.tiles[1] + ch) * g.tiles[2] + cw)] = 1;
    push_row(m, keep);
  }
  return m;
}

CallTiling tile_call(const AttentionProblem& p, const VideoSparseOptions& o) {
  if (p.video_layout == nullptr)
    return {VideoTiling::dense(p.sq, o.dense_block), VideoTiling::dense(p.skv, o.dense_block)};
  VideoTiling q = VideoTiling::build(*p.video_layout, p.sq, o.tile, o.dense_block);
  if (p.skv == p.sq) return {q, q};
  return {std::move(q), VideoTiling::dense(p.skv, o.dense_block)};
}

PooledBlocks pool_blocks(const AttentionProblem& p, const CallTiling& t, bool with_values) {
  PooledBlocks out;
  const auto& qblocks = t.queries.blocks();
  const auto& kblocks = t.keys.blocks();
  const i64 nq = static_cast<i64>(qblocks.size()), nk = static_cast<i64>(kblocks.size());
  out.qblocks = nq;
  out.kblocks = nk;
  out.q.assign(std::size_t(p.batch * p.hq * nq * p.d), 0.0f);
  out.k.assign(std::size_t(p.batch * p.hkv * nk * p.d), 0.0f);
  if (with_values) out.v.assign(std::size_t(p.batch * p.hkv * nk * p.dv), 0.0f);
  out.q_rows.assign(std::size_t(p.batch * nq), 0);
  out.k_rows.assign(std::size_t(p.batch * nk), 0);
  for (i64 b = 0; b < p.batch; ++b) {
    // Valid query rows: inside a segment; valid keys: inside its key range and kept.
    std::vector<char> q_valid(std::size_t(p.sq), 0), k_valid(std::size_t(p.skv), 0);
    for (const Segment& s : p.segments) {
      if (s.batch != b) continue;
      for (i64 i = s.q_begin; i < s.q_end; ++i)
        q_valid[std::size_t(i)] = !p.zero_masked_query_rows || p.mask.keeps_key(b, i);
      for (i64 j = s.k_begin; j < s.k_end; ++j) k_valid[std::size_t(j)] = p.mask.keeps_key(b, j);
    }
    const auto pool = [&](const std::vector<VideoBlock>& blocks, const VideoTiling& tiling,
                          const std::vector<char>& valid, i64 heads, i64 width,
                          RowRef (AttentionProblem::*row_of)(i64) const, std::vector<float>& dst,
                          std::vector<i64>* counts) {
      const auto nb = static_cast<i64>(blocks.size());
#pragma omp parallel for schedule(dynamic, 8) num_threads(std::max(p.threads, 1))
      for (i64 n = 0; n < nb; ++n) {
        const VideoBlock& blk = blocks[std::size_t(n)];
        i64 rows = 0;
        for (i64 pos = blk.begin; pos < blk.end; ++pos)
          rows += valid[std::size_t(tiling.order()[std::size_t(pos)])];
        if (counts) (*counts)[std::size_t(b * nb + n)] = rows;
        if (rows == 0) continue;
        for (i64 h = 0; h < heads; ++h) {
          float* acc = dst.data() + ((b * heads + h) * nb + n) * width;  // zeros
          for (i64 pos = blk.begin; pos < blk.end; ++pos) {
            const i64 row = tiling.order()[std::size_t(pos)];
            if (valid[std::size_t(row)]) accumulate((p.*row_of)(row), b, h, width, acc);
          }
          const float inv = 1.0f / static_cast<float>(rows);
          for (i64 e = 0; e < width; ++e) acc[e] *= inv;
        }
      }
    };
    pool(qblocks, t.queries, q_valid, p.hq, p.d, &AttentionProblem::q_row, out.q, &out.q_rows);
    pool(kblocks, t.keys, k_valid, p.hkv, p.d, &AttentionProblem::k_row, out.k, &out.k_rows);
    if (with_values)
      pool(kblocks, t.keys, k_valid, p.hkv, p.dv, &AttentionProblem::v_row, out.v, nullptr);
  }
  return out;
}

BlockMap select_blocks(const AttentionProblem& p, const CallTiling& t, const VideoSparseOptions& o,
                       const PooledBlocks* pooled) {
  switch (o.selection) {
    case BlockSelection::sliding_tile:
      return sliding_tile_map(t.queries, t.keys, o.window);
    case BlockSelection::explicit_map:
      return explicit_map(p, t, o);
    case BlockSelection::topk:
      break;
  }
  if (pooled != nullptr) return topk_map(p, t, o, *pooled);
  const PooledBlocks own = pool_blocks(p, t, false);
  return topk_map(p, t, o, own);
}

VideoSparseSelection video_sparse_selection(const AttentionConfig& config,
                                            const AttentionInputs& in) {
  const double scale =
      config.softmax_scale.value_or(1.0 / std::sqrt(double(std::max<i64>(config.head_size, 1))));
  detail::PrepareOptions opts;
  opts.honour_packed_padding = false;  // as VIDEO_SPARSE, which does not claim it
  const detail::PreparedCall call =
      detail::prepare_call(config, scale, config.num_kv_heads.value_or(config.num_heads), in, opts);
  const AttentionProblem& p = call.problem;
  VideoSparseSelection s{
      {}, VideoSparseOptions::from(config.backend_options, p.backend_options), {}};
  s.tiling = tile_call(p, s.options);
  s.map = select_blocks(p, s.tiling, s.options, nullptr);
  return s;
}

}  // namespace dattn
