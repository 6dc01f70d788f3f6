// The workload table: attention shapes of real diffusion transformers, named after the models
// they come from. The CLI (`dattn run`), the tests and the benchmarks share it. A Workload is
// only a description (no tensors); build_workload_inputs() allocates and fills its inputs.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn::cli {

// Which mask a workload carries.
enum class WorkloadMask : std::uint8_t {
  none,
  key_padding,    // attn_mask bool [B, Skv]: the first `kept_rows` keys are kept
  joint_padding,  // joint_attn_mask bool [B, J]: the first `kept_rows` joint rows are kept
};

struct Workload {
  std::string name;
  std::string description;
  std::int64_t batch = 1;
  std::int64_t joint_rows = 0;  // J text rows passed as joint_query/key/value
  std::int64_t query_rows = 0;  // Sq image/video rows (packed: all documents together)
  std::int64_t key_rows = 0;    // Skv (self-attention: == query_rows)
  std::int64_t heads = 0;       // Hq
  std::int64_t kv_heads = 0;    // Hkv
  std::int64_t head_size = 0;   // D == Dv
  bool causal = false;
  AttentionRole role = AttentionRole::self;
  JointStrategy joint_strategy = JointStrategy::front;
  WorkloadMask mask = WorkloadMask::none;
  std::int64_t kept_rows = 0;  // rows the mask keeps (see WorkloadMask)
  std::optional<VideoTokenLayout> video_layout;
  // Packed THD batch: the document lengths (empty documents allowed). Empty = not packed;
  // when set, query_rows == key_rows == their sum and the layout is THD.
  std::vector<std::int64_t> documents;
  // prefix-reuse: the first prefix_rows of the query_rows are a conditioning prefix cached in
  // pages; each denoising step recomputes only the other (target) rows.
  std::int64_t prefix_rows = 0;

  bool packed() const { return !documents.empty(); }
  QkvLayout layout() const { return packed() ? QkvLayout::THD : QkvLayout::BSHD; }
  // Rows of the layer's output per batch item: J + Sq.
  std::int64_t output_rows() const { return joint_rows + query_rows; }
};

// Every workload, the default (`small`) first.
std::span<const Workload> workloads();
// nullptr when there is no workload of that name (exact match).
const Workload* find_workload(std::string_view name);
std::vector<std::string> workload_names();

// `workload` with Hq = `heads` and Hkv scaled to keep the GQA ratio (at least 1, and dividing
// `heads`). Example: Hq 24, Hkv 8, heads 6 -> Hq 6, Hkv 2. Throws InvalidArgument if heads < 1.
Workload with_heads(Workload workload, std::int64_t heads);

// Floating-point operations of one forward call, counting only the work that is not masked
// away: 2*D flops per (query row, visible key) pair for Q.K^T and 2*Dv for P.V, over all heads
// and batch items. See attention_flops() in workloads.cpp for the counting rule per form.
double attention_flops(const Workload& workload);

// A workload's tensors and metadata. The metadata's views point into the tensors held here
// (copies and moves share the storage, so the struct can be returned and moved freely).
// Layout: BSHD q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D]; THD (packed) q [T, Hq, D], k/v
// [T, Hkv, D]. Joint tensors [B, J, H, D]. Masks bool; cu_seqlens int32 [docs + 1].
struct WorkloadInputs {
  Tensor q, k, v;
  Tensor joint_q, joint_k, joint_v;
  Tensor attn_mask, joint_attn_mask;
  Tensor cu_seqlens;  // shared by cu_seqlens_q and cu_seqlens_k
  AttentionMetadata metadata;
};

// Allocates and fills the inputs of `workload`: Q, K, V (and joint Q/K/V) with N(0, 1) values
// rounded to `dtype`, reproducible from `seed` whatever the thread count; masks and cu_seqlens
// as the workload describes.
WorkloadInputs build_workload_inputs(const Workload& workload, DType dtype, std::uint64_t seed);

// Replaces the Q, K and V values of the video rows of a BSHD workload with a smooth signal of
// their (t, h, w) position: per head and channel, sin(a t + b h + c w + phase) plus a little
// noise, the same frequencies for Q and K (Q scaled by 2.5), so that attention is local and
// peaked as in a trained video model.
// Rows outside the video grids keep their random values. No-op for packed workloads.
void fill_smooth_video_signal(WorkloadInputs& inputs, const Workload& workload, std::uint64_t seed);

// The layer configuration that runs `workload` (backend left empty = automatic).
AttentionConfig workload_attention_config(const Workload& workload, DType dtype);

}  // namespace dattn::cli
