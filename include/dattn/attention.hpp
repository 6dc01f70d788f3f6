// The Attention layer: validates a call, attaches joint tokens, checks the backend's
// capabilities, and runs the chosen backend's impl (docs/architecture.md, "The flow of one call").
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "dattn/backend.hpp"
#include "dattn/metadata.hpp"
#include "dattn/parallel.hpp"
#include "dattn/registry.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

enum class AttentionRole : std::uint8_t { self, cross };
AttentionRole parse_attention_role(std::string_view s);  // throws InvalidArgument
std::string_view attention_role_name(AttentionRole r);

struct AttentionConfig {
  std::int64_t num_heads = 0;
  std::int64_t head_size = 0;
  std::optional<double> softmax_scale;  // default head_size^-0.5
  bool causal = false;
  std::optional<std::int64_t> num_kv_heads;  // default num_heads
  std::string prefix;                        // the layer's name, for messages
  AttentionRole role = AttentionRole::self;
  QkvLayout qkv_layout = QkvLayout::BSHD;
  // Backend name (case-insensitive); empty or "auto" defers to DIFFUSION_ATTENTION_BACKEND,
  // then to automatic choice.
  std::string backend;
  BackendOptions backend_options;  // passed to the impl as backend_kwargs
  // With an explicit (or env) choice: a call the backend cannot serve runs on the best exact
  // backend that can (forward_into returns which), instead of raising Unsupported. Automatic
  // choice always falls back.
  bool allow_fallback = false;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::unquantized;
  Platform platform = Platform::cpu;
  std::optional<DType> dtype;  // Q's dtype, if known, to validate the choice up front
  std::shared_ptr<const ParallelStrategy> parallel;  // null = one process
  const Registry* registry = nullptr;                // null = Registry::global()
};

struct ForwardResult {
  Tensor out;
  std::optional<Tensor> lse;
};

class Attention {
 public:
  // Chooses the backend and makes its impl. Throws InvalidArgument for a bad config,
  // NotAvailable/Unsupported when an explicit choice cannot run here.
  explicit Attention(AttentionConfig config);
  ~Attention();
  Attention(Attention&&) noexcept;
  Attention& operator=(Attention&&) noexcept;

  // Output [B, J + Sq, Hq, Dv] in Q's dtype (layout of qkv_layout), LSE f32 [B, Hq, J + Sq].
  ForwardResult forward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const AttentionMetadata& metadata = {}, bool want_lse = false) const;
  // Writes into caller buffers. On any error nothing is written. Returns the backend that ran
  // the call (under automatic choice, a call needing a feature the layer's backend lacks runs
  // on the best backend that has it).
  const Backend& forward_into(const TensorView& q, const TensorView& k, const TensorView& v,
                              const AttentionMetadata& metadata, const TensorView& out,
                              const std::optional<TensorView>& lse = std::nullopt) const;
  // One paged-KV call; Unsupported unless the backend supports paged KV.
  void forward_paged(const PagedAttentionCall& call) const;

  const Backend& backend() const;
  const Impl& impl() const;
  const AttentionConfig& config() const;
  // How the backend was chosen and why others were skipped.
  const Selection& selection() const;
  // The compute engine that ran this layer's most recent call: Plan::engine() of the plan the
  // backend that ran it (the layer's own, or a fallback's) last ran, e.g. "avx512",
  // "avx512_bf16" (dattn/engines.hpp). Dense, paged and sequence-parallel calls alike; empty
  // before the first call and when that backend has no engines (REFERENCE). With calls on
  // several threads at once, the engine of one of the latest.
  std::string last_engine() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dattn
