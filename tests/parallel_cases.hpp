// Sequence-parallel cases shared by the in-process tests (threads as ranks) and the MPI tests
// (processes as ranks): every rank builds the same inputs, computes the single-process result
// of the whole sequence itself, runs its shard through the strategy and compares its rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/communicator.hpp"
#include "dattn/parallel.hpp"
#include "test_inputs.hpp"

namespace dattn::testing {

struct ParallelCase {
  std::string strategy = "ulysses";  // as make_parallel_strategy takes it
  std::int64_t batch = 2, heads = 8, kv_heads = 2, d = 40, dv = 40;
  std::int64_t rows = 37;             // query and key rows of the whole sequence
  std::vector<std::int64_t> lengths;  // rows per rank; empty: shard_rows
  std::int64_t joint = 0;
  bool front = true;
  bool causal = false;
  std::optional<std::int64_t> valid_kv_length;
  bool key_mask = false;      // 2-D bool key mask (each rank passes its own columns)
  bool joint_mask = false;    // joint_attn_mask
  bool dense_mask = false;    // 4-D additive mask over the whole sequence [1, H, J+S, J+S]
  bool packed = false;        // cu_seqlens over the whole sequence (batch 1, three documents)
  bool video_layout = false;  // a one-tail video layout over the whole sequence
  DType dtype = DType::F32;
  bool bhsd = false;  // the parallel layer reads and writes BHSD views of the same tensors
  std::string backend = "FLASH";
  std::uint32_t seed = 7;
  // A bad input on one rank only (its parallel call; the single-process result stays good).
  int bad_rank = -1;
  std::int64_t bad_key_head_size = 0;               // keys of another head size
  std::optional<std::int64_t> bad_valid_kv_length;  // a valid_kv_length past the keys
};

struct ParallelOutcome {
  double out_err = 0;  // max |parallel - single process| over this rank's rows, all heads
  double lse_err = 0;  // the same over the finite LSE values (a -inf must match a -inf)
};

// This rank's rows [start, start + length) of the whole sequence.
inline std::pair<std::int64_t, std::int64_t> case_shard(const ParallelCase& c, int ranks,
                                                        int rank) {
  if (c.lengths.empty()) return shard_rows(c.rows, ranks, rank);
  std::int64_t start = 0;
  for (int p = 0; p < rank; ++p) start += c.lengths[std::size_t(p)];
  return {start, c.lengths[std::size_t(rank)]};
}

inline std::int64_t case_rows(const ParallelCase& c) {
  if (c.lengths.empty()) return c.rows;
  std::int64_t n = 0;
  for (std::int64_t l : c.lengths) n += l;
  return n;
}

// Runs `c` on this rank of `comm`; throws what the layer throws.
inline ParallelOutcome run_parallel_case(const std::shared_ptr<Communicator>& comm,
                                         const ParallelCase& c) {
  using i64 = std::int64_t;
  const i64 S = case_rows(c), J = c.joint, B = c.packed ? 1 : c.batch;
  const Tensor q = random_tensor({B, S, c.heads, c.d}, c.dtype, c.seed);
  const Tensor k = random_tensor({B, S, c.kv_heads, c.d}, c.dtype, c.seed + 1);
  const Tensor v = random_tensor({B, S, c.kv_heads, c.dv}, c.dtype, c.seed + 2);
  const Tensor jq = random_tensor({B, J, c.heads, c.d}, c.dtype, c.seed + 3);
  const Tensor jk = random_tensor({B, J, c.kv_heads, c.d}, c.dtype, c.seed + 4);
  const Tensor jv = random_tensor({B, J, c.kv_heads, c.dv}, c.dtype, c.seed + 5);
  Tensor key_mask = bool_tensor({B, S}, c.seed + 6, 0.8);
  Tensor joint_mask = bool_tensor({B, J}, c.seed + 7, 0.7);
  const Tensor dense = random_tensor({1, c.heads, J + S, J + S}, DType::F32, c.seed + 8, 2.0f);
  const std::int32_t s32 = static_cast<std::int32_t>(S);
  const Tensor cu = int32_tensor({0, s32 / 3, s32 / 3, s32});  // one empty document

  const AttentionConfig config = layer_config(c.backend, c.heads, c.kv_heads, c.d, c.causal);
  AttentionMetadata whole;
  if (J > 0) {
    whole.joint_query = jq.view();
    whole.joint_key = jk.view();
    whole.joint_value = jv.view();
    whole.joint_strategy = c.front ? JointStrategy::front : JointStrategy::rear;
    if (c.joint_mask) whole.joint_attn_mask = joint_mask.view();
  }
  if (c.key_mask) whole.attn_mask = key_mask.view();
  if (c.dense_mask) whole.attn_mask = dense.view();
  whole.extra.valid_kv_length = c.valid_kv_length;
  if (c.video_layout) {
    whole.video_layout = VideoTokenLayout{};
    whole.video_layout->prefix_len = 0;
    whole.video_layout->latent_grid = LatentGrid{1, 1, S};
  }
  if (c.packed) {
    whole.extra.cu_seqlens_q = cu.view();
    whole.extra.cu_seqlens_k = cu.view();
    whole.extra.max_seqlen_q = S - s32 / 3;
    whole.extra.max_seqlen_k = S - s32 / 3;
  }
  const Attention single(config);
  const ForwardResult want = single.forward(q, k, v, whole, true);

  const auto [start, length] = case_shard(c, comm->size(), comm->rank());
  AttentionConfig pconfig = config;
  pconfig.parallel = make_parallel_strategy(c.strategy, comm);
  const std::array<int, 4> swap{0, 2, 1, 3};
  auto in_layout = [&](const TensorView& t) { return c.bhsd ? t.permuted(swap) : t; };
  if (c.bhsd) pconfig.qkv_layout = QkvLayout::BHSD;
  const Attention layer(pconfig);
  AttentionMetadata mine = whole;
  if (c.key_mask) mine.attn_mask = key_mask.view().sliced(1, start, length);
  if (c.bhsd && J > 0) {
    mine.joint_query = in_layout(jq.view());
    mine.joint_key = in_layout(jk.view());
    mine.joint_value = in_layout(jv.view());
  }
  TensorView k_mine = k.view().sliced(1, start, length);
  const Tensor k_bad = random_tensor({B, length, c.kv_heads, std::max<i64>(1, c.bad_key_head_size)},
                                     c.dtype, c.seed + 9);
  if (comm->rank() == c.bad_rank) {
    if (c.bad_key_head_size > 0) k_mine = k_bad.view();
    if (c.bad_valid_kv_length) mine.extra.valid_kv_length = c.bad_valid_kv_length;
  }
  const ForwardResult got_raw =
      layer.forward(in_layout(q.view().sliced(1, start, length)), in_layout(k_mine),
                    in_layout(v.view().sliced(1, start, length)), mine, true);
  const TensorView got_out = in_layout(got_raw.out.view());  // back to BSHD
  const TensorView got_lse = got_raw.lse->view();

  // Rows of the single-process output that this rank holds, in its order.
  const i64 want_local0 = (c.front ? J : 0) + start, want_joint0 = c.front ? 0 : S;
  const i64 got_local0 = c.front ? J : 0, got_joint0 = c.front ? 0 : length;
  ParallelOutcome o;
  auto compare = [&](i64 got_row, i64 want_row, i64 n) {
    for (i64 b = 0; b < B; ++b)
      for (i64 i = 0; i < n; ++i)
        for (i64 h = 0; h < c.heads; ++h) {
          for (i64 e = 0; e < c.dv; ++e) {
            const std::array<i64, 4> gi{b, got_row + i, h, e}, wi{b, want_row + i, h, e};
            const double x = load_as_f32(got_out.element_ptr(gi), got_out.dtype(), 0);
            const double y = load_as_f32(want.out.view().element_ptr(wi), want.out.dtype(), 0);
            o.out_err = std::max(o.out_err, std::isnan(x - y) ? 1e30 : std::fabs(x - y));
          }
          const std::array<i64, 3> gl{b, h, got_row + i}, wl{b, h, want_row + i};
          const double x = load_as_f32(got_lse.element_ptr(gl), DType::F32, 0);
          const double y = load_as_f32(want.lse->view().element_ptr(wl), DType::F32, 0);
          if (std::isinf(x) || std::isinf(y))
            o.lse_err = std::max(o.lse_err, x == y ? 0.0 : 1e30);
          else
            o.lse_err = std::max(o.lse_err, std::isnan(x - y) ? 1e30 : std::fabs(x - y));
        }
  };
  compare(got_local0, want_local0, length);
  compare(got_joint0, want_joint0, J);
  return o;
}

}  // namespace dattn::testing
