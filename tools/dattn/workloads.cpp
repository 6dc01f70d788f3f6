#include "workloads.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "dattn/errors.hpp"
#include "dattn/threads.hpp"

namespace dattn::cli {

namespace {

using i64 = std::int64_t;

std::vector<Workload> make_workloads() {
  std::vector<Workload> table;

  Workload small;
  small.name = "small";
  small.description = "default: 77 joint text rows (front) + 256 image rows, 4 heads, D 64";
  small.joint_rows = 77;
  small.query_rows = small.key_rows = 256;
  small.heads = small.kv_heads = 4;
  small.head_size = 64;
  table.push_back(small);

  Workload flux;
  flux.name = "flux-1024";
  flux.description = "FLUX.1 1024x1024: 512 joint text rows (front) + 4096 image rows, 24 heads";
  flux.joint_rows = 512;
  flux.query_rows = flux.key_rows = 4096;
  flux.heads = flux.kv_heads = 24;
  flux.head_size = 128;
  table.push_back(flux);

  Workload sd35;
  sd35.name = "sd35-1024";
  sd35.description = "SD3.5 1024x1024: 333 joint text rows (front) + 4096 image rows, 38 heads";
  sd35.joint_rows = 333;
  sd35.query_rows = sd35.key_rows = 4096;
  sd35.heads = sd35.kv_heads = 38;
  sd35.head_size = 64;
  table.push_back(sd35);

  Workload wan;
  wan.name = "wan-480p";
  wan.description = "Wan 2.1 480p 81 frames: self-attention over a 21x30x52 video grid";
  wan.query_rows = wan.key_rows = 21 * 30 * 52;
  wan.heads = wan.kv_heads = 12;
  wan.head_size = 128;
  wan.video_layout.emplace();
  wan.video_layout->prefix_len = 0;
  wan.video_layout->latent_grid = LatentGrid{21, 30, 52};
  table.push_back(wan);

  Workload wan_cross;
  wan_cross.name = "wan-480p-cross";
  wan_cross.description =
      "Wan 2.1 480p cross-attention: 32760 video rows vs 512 text keys, 200 kept by padding";
  wan_cross.query_rows = 21 * 30 * 52;
  wan_cross.key_rows = 512;
  wan_cross.heads = wan_cross.kv_heads = 12;
  wan_cross.head_size = 128;
  wan_cross.role = AttentionRole::cross;
  wan_cross.mask = WorkloadMask::key_padding;
  wan_cross.kept_rows = 200;
  table.push_back(wan_cross);

  Workload qwen;
  qwen.name = "qwen-image-1024";
  qwen.description =
      "Qwen-Image 1024x1024: 256 padded joint text rows (150 kept) + 4096 image rows";
  qwen.joint_rows = 256;
  qwen.query_rows = qwen.key_rows = 4096;
  qwen.heads = qwen.kv_heads = 24;
  qwen.head_size = 128;
  qwen.mask = WorkloadMask::joint_padding;
  qwen.kept_rows = 150;
  table.push_back(qwen);

  Workload hunyuan;
  hunyuan.name = "hunyuan-720p";
  hunyuan.description =
      "HunyuanVideo 720x1280, 129 frames: [256 text | 33x45x80 video] rows in one sequence";
  // The text rows are packed in front of the video rows (the one-tail VideoTokenLayout), as
  // HunyuanVideo's single-stream blocks do; 119056 rows in all.
  hunyuan.query_rows = hunyuan.key_rows = 256 + 33 * 45 * 80;
  hunyuan.video_layout = VideoTokenLayout{256, LatentGrid{33, 45, 80}, std::nullopt, {}};
  hunyuan.heads = hunyuan.kv_heads = 24;
  hunyuan.head_size = 128;
  table.push_back(hunyuan);

  Workload video;
  video.name = "video-small";
  video.description =
      "a small video for tests and demos: [32 text | 8x12x16 video] rows in one sequence, 4 heads";
  video.query_rows = video.key_rows = 32 + 8 * 12 * 16;
  video.video_layout = VideoTokenLayout{32, LatentGrid{8, 12, 16}, std::nullopt, {}};
  video.heads = video.kv_heads = 4;
  video.head_size = 64;
  table.push_back(video);

  Workload reuse;
  reuse.name = "prefix-reuse";
  reuse.description =
      "HunyuanImage-3.0-like denoising steps: a 3072-row cached prefix (text + reference image) "
      "+ 4096 target rows, 32 heads; paged prefix cache against recomputing every row";
  reuse.prefix_rows = 3072;
  reuse.query_rows = reuse.key_rows = 3072 + 4096;
  reuse.heads = reuse.kv_heads = 32;
  reuse.head_size = 128;
  table.push_back(reuse);

  Workload packed;
  packed.name = "packed-docs";
  packed.description = "THD packed batch of 5 documents (1000, 517, 0, 2048, 777 rows), 16 heads";
  packed.documents = {1000, 517, 0, 2048, 777};
  packed.query_rows = packed.key_rows =
      std::accumulate(packed.documents.begin(), packed.documents.end(), i64{0});
  packed.heads = packed.kv_heads = 16;
  packed.head_size = 128;
  table.push_back(packed);

  return table;
}

// Visible (query, key) pairs of `queries` rows against `keys` keys. Non-causal: all of them.
// Causal (bottom-right aligned, docs/semantics.md, "Positions and causality"): row i sees min(keys,
// max(0, keys - queries + i + 1)) keys. Example: 4 queries, 4 keys -> 1 + 2 + 3 + 4 = 10 pairs; 2
// queries, 4 keys -> 3 + 4 = 7.
double visible_pairs(i64 queries, i64 keys, bool causal) {
  if (!causal) return double(queries) * double(keys);
  double pairs = 0;
  for (i64 i = 0; i < queries; ++i)
    pairs += double(std::clamp<i64>(keys - queries + i + 1, 0, keys));
  return pairs;
}

// splitmix64: decorrelates the seeds of neighbouring chunks.
std::uint64_t mix_seed(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A tensor of N(0, 1) values rounded to `dtype`. Filled in fixed chunks, each with its own
// generator seeded from (seed, stream, chunk), so the values do not depend on the thread count.
Tensor random_normal(std::initializer_list<i64> shape, DType dtype, std::uint64_t seed,
                     std::uint64_t stream) {
  constexpr i64 kChunk = i64{1} << 16;
  Tensor t = Tensor::empty(shape, dtype);
  const i64 n = t.numel();
  const i64 chunks = (n + kChunk - 1) / kChunk;
  void* data = t.data();
#pragma omp parallel for schedule(static) num_threads(dattn::default_threads())
  for (i64 c = 0; c < chunks; ++c) {
    std::mt19937_64 rng(mix_seed(seed ^ mix_seed(stream * 0x100000001b3ull + std::uint64_t(c))));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const i64 end = std::min(n, (c + 1) * kChunk);
    for (i64 i = c * kChunk; i < end; ++i) store_from_f32(data, dtype, i, normal(rng));
  }
  return t;
}

// bool [batch, rows] keeping the first `kept` rows of every batch item.
Tensor prefix_keep_mask(i64 batch, i64 rows, i64 kept) {
  Tensor t = Tensor::zeros({batch, rows}, DType::Bool);
  auto* bytes = t.data_as<std::uint8_t>();
  for (i64 b = 0; b < batch; ++b) std::memset(bytes + b * rows, 1, std::size_t(kept));
  return t;
}

}  // namespace

std::span<const Workload> workloads() {
  static const std::vector<Workload> table = make_workloads();
  return table;
}

const Workload* find_workload(std::string_view name) {
  for (const Workload& w : workloads())
    if (w.name == name) return &w;
  return nullptr;
}

std::vector<std::string> workload_names() {
  std::vector<std::string> names;
  for (const Workload& w : workloads()) names.push_back(w.name);
  return names;
}

Workload with_heads(Workload workload, std::int64_t heads) {
  if (heads < 1)
    throw InvalidArgument("heads", "heads = " + std::to_string(heads) + " must be at least 1");
  i64 kv_heads = std::max<i64>(1, heads * workload.kv_heads / workload.heads);
  while (heads % kv_heads != 0) --kv_heads;
  workload.heads = heads;
  workload.kv_heads = kv_heads;
  return workload;
}

// Counting rule: 4 * D flops (2*D for Q.K^T, 2*Dv for P.V, Dv == D) per visible (query row,
// key) pair, per head and batch item; softmax and masking are not counted.
//  - packed documents: the sum over documents of the pairs inside each document (block
//    diagonal; empty documents cost nothing);
//  - otherwise the joint rows count as queries and keys (the layer attaches them), a padding
//    mask removes the keys it hides, and in self-attention also the query rows it hides (their
//    output is zero without computing, docs/semantics.md, "Masks"); cross-attention computes every
//    query row;
//  - causal: the bottom-right triangle of the valid rows and keys (visible_pairs), which
//    treats the kept rows as one contiguous run.
// Example: `small` = 4 * 64 * (333 * 333) * 4 heads = 113.5 MFLOP.
double attention_flops(const Workload& workload) {
  const auto& w = workload;
  double pairs = 0;
  if (w.packed()) {
    for (i64 len : w.documents) pairs += visible_pairs(len, len, w.causal);
  } else {
    i64 queries = w.joint_rows + w.query_rows;
    i64 keys = w.joint_rows + w.key_rows;
    if (w.mask == WorkloadMask::key_padding) keys = w.joint_rows + w.kept_rows;
    if (w.mask == WorkloadMask::joint_padding) keys = w.kept_rows + w.key_rows;
    const bool self_attention = w.role == AttentionRole::self && w.query_rows == w.key_rows;
    if (w.mask != WorkloadMask::none && self_attention) queries = keys;
    pairs = visible_pairs(queries, keys, w.causal);
  }
  return 4.0 * double(w.head_size) * pairs * double(w.heads) * double(w.batch);
}

WorkloadInputs build_workload_inputs(const Workload& workload, DType dtype, std::uint64_t seed) {
  const auto& w = workload;
  WorkloadInputs in;
  AttentionMetadata& m = in.metadata;
  if (w.packed()) {
    in.q = random_normal({w.query_rows, w.heads, w.head_size}, dtype, seed, 0);
    in.k = random_normal({w.key_rows, w.kv_heads, w.head_size}, dtype, seed, 1);
    in.v = random_normal({w.key_rows, w.kv_heads, w.head_size}, dtype, seed, 2);
    const auto docs = i64(w.documents.size());
    in.cu_seqlens = Tensor::empty({docs + 1}, DType::I32);
    auto* cu = in.cu_seqlens.data_as<std::int32_t>();
    cu[0] = 0;
    for (i64 d = 0; d < docs; ++d)
      cu[d + 1] = cu[d] + static_cast<std::int32_t>(w.documents[std::size_t(d)]);
    const i64 longest = *std::max_element(w.documents.begin(), w.documents.end());
    m.extra.cu_seqlens_q = m.extra.cu_seqlens_k = in.cu_seqlens.view();
    m.extra.max_seqlen_q = m.extra.max_seqlen_k = longest;
    return in;
  }
  in.q = random_normal({w.batch, w.query_rows, w.heads, w.head_size}, dtype, seed, 0);
  in.k = random_normal({w.batch, w.key_rows, w.kv_heads, w.head_size}, dtype, seed, 1);
  in.v = random_normal({w.batch, w.key_rows, w.kv_heads, w.head_size}, dtype, seed, 2);
  if (w.joint_rows > 0) {
    in.joint_q = random_normal({w.batch, w.joint_rows, w.heads, w.head_size}, dtype, seed, 3);
    in.joint_k = random_normal({w.batch, w.joint_rows, w.kv_heads, w.head_size}, dtype, seed, 4);
    in.joint_v = random_normal({w.batch, w.joint_rows, w.kv_heads, w.head_size}, dtype, seed, 5);
    m.joint_query = in.joint_q.view();
    m.joint_key = in.joint_k.view();
    m.joint_value = in.joint_v.view();
    m.joint_strategy = w.joint_strategy;
  }
  switch (w.mask) {
    case WorkloadMask::none:
      break;
    case WorkloadMask::key_padding:
      in.attn_mask = prefix_keep_mask(w.batch, w.key_rows, w.kept_rows);
      m.attn_mask = in.attn_mask.view();
      m.extra.attention_mask_mode = AttentionMaskMode::padding;
      break;
    case WorkloadMask::joint_padding:
      in.joint_attn_mask = prefix_keep_mask(w.batch, w.joint_rows, w.kept_rows);
      m.joint_attn_mask = in.joint_attn_mask.view();
      m.extra.attention_mask_mode = AttentionMaskMode::padding;
      break;
  }
  m.video_layout = w.video_layout;
  return in;
}

void fill_smooth_video_signal(WorkloadInputs& inputs, const Workload& w, std::uint64_t seed) {
  if (w.packed() || !w.video_layout) return;
  // The grids of the layout, in rows of the concatenated sequence [joint | rows] (front).
  std::vector<VideoTokenSpan> grids = w.video_layout->video_spans;
  if (w.video_layout->latent_grid)
    grids.push_back(
        {w.video_layout->prefix_len.value_or(0), *w.video_layout->latent_grid, VideoRole::target});
  std::mt19937_64 rng(seed ^ 0x5eedull);
  std::uniform_real_distribution<double> freq(0.0, 0.6), phase(0.0, 6.283185307179586);
  const i64 d = w.head_size;
  const i64 heads = std::max(w.heads, w.kv_heads);
  // Frequencies and phases per (head, channel); V gets its own phases.
  std::vector<std::array<double, 5>> wave(std::size_t(heads * d));
  for (auto& f : wave) f = {freq(rng), freq(rng), freq(rng), phase(rng), phase(rng)};
  const auto fill = [&](Tensor& t, i64 row_offset, bool value, double amplitude) {
    if (t.numel() == 0) return;
    const i64 rows = t.view().size(1), th = t.view().size(2);
    for (const VideoTokenSpan& g : grids)
      for (i64 n = 0; n < g.length(); ++n) {
        const i64 r = g.start + n - row_offset;
        if (r < 0 || r >= rows) continue;
        const i64 z = n / (g.latent_grid[1] * g.latent_grid[2]);
        const i64 y = n / g.latent_grid[2] % g.latent_grid[1], x = n % g.latent_grid[2];
        for (i64 b = 0; b < w.batch; ++b)
          for (i64 h = 0; h < th; ++h)
            for (i64 e = 0; e < d; ++e) {
              const auto& f = wave[std::size_t(h * d + e)];
              const i64 at = ((b * rows + r) * th + h) * d + e;
              const double noise = 0.1 * load_as_f32(t.data(), t.dtype(), at);
              const double s = std::sin(f[0] * double(z) + f[1] * double(y) + f[2] * double(x) +
                                        f[value ? 4 : 3]);
              store_from_f32(t.data(), t.dtype(), at, static_cast<float>(amplitude * s + noise));
            }
      }
  };
  const i64 offset = w.joint_strategy == JointStrategy::front ? w.joint_rows : 0;
  // Q at 2.5x: a token's logit with itself (about 2.5 sqrt(D) / 2) then stands far above the
  // tens of thousands of unrelated keys, as attention does in trained video models.
  fill(inputs.q, offset, false, 2.5);
  fill(inputs.k, offset, false, 1.0);
  fill(inputs.v, offset, true, 1.0);
}

AttentionConfig workload_attention_config(const Workload& workload, DType dtype) {
  AttentionConfig config;
  config.num_heads = workload.heads;
  config.num_kv_heads = workload.kv_heads;
  config.head_size = workload.head_size;
  config.causal = workload.causal;
  config.role = workload.role;
  config.qkv_layout = workload.layout();
  config.dtype = dtype;
  config.prefix = workload.name;
  return config;
}

}  // namespace dattn::cli
