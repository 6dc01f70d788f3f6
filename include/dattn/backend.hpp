// The backend contract (docs/semantics.md, "Capabilities and selection"): a Backend declares
// capabilities and makes Impls; an Impl plans and runs calls on the platform where the tensors
// live.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dattn/capabilities.hpp"
#include "dattn/inputs.hpp"
#include "dattn/metadata.hpp"
#include "dattn/paged.hpp"
#include "dattn/problem.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

// The seed's AttentionImpl.__init__ arguments.
struct ImplConfig {
  std::int64_t num_heads = 0;
  std::int64_t head_size = 0;
  double softmax_scale = 1.0;
  bool causal = false;
  std::int64_t num_kv_heads = 0;
  std::string prefix;  // the layer's name in the model, for messages
  QkvLayout qkv_layout = QkvLayout::BSHD;
  BackendOptions backend_kwargs;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::unquantized;
  Platform platform = Platform::cpu;
};

// A value type made by Impl::plan: everything that depends only on shapes and metadata.
class Plan {
 public:
  explicit Plan(std::uint64_t signature) : signature_(signature) {}
  virtual ~Plan() = default;
  std::uint64_t signature() const { return signature_; }
  virtual std::string to_string() const = 0;
  // Scratch memory one thread uses while running the plan.
  virtual std::size_t scratch_bytes_per_thread() const { return 0; }
  // The compute engine that runs the plan (FLASH's engine table, dattn/engines.hpp: "avx512",
  // "avx512_bf16", "amx", ...); empty for backends without engines.
  virtual std::string engine() const { return {}; }

 private:
  std::uint64_t signature_;
};

class Backend;

class Impl {
 public:
  Impl(const Backend& backend, ImplConfig config);
  virtual ~Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  const Backend& backend() const { return backend_; }
  const ImplConfig& config() const { return config_; }

  // Per-platform quantized KV dtypes (the seed's _supported_kv_cache_dtypes). By default the
  // backend's capabilities().kv_cache_dtypes; an impl may narrow it for its config, never widen
  // it (the registry's refusal reads the backend's declaration).
  virtual std::map<Platform, std::vector<KvCacheDtype>> supported_kv_cache_dtypes() const;
  // `unquantized` is always supported.
  bool supports_kv_cache_dtype(KvCacheDtype dtype, Platform platform) const;

  // Shapes and metadata -> plan (the seed's metadata builder).
  virtual std::unique_ptr<Plan> plan(const AttentionProblem& problem) const = 0;
  // Runs `plan` on `problem` (same signature), dispatching on the platform of Q:
  // cpu -> run_cpu, cuda -> run_cuda, rocm -> run_hip (defaults to cuda), musa -> run_musa
  // (defaults to cuda), npu -> run_npu, xpu -> run_xpu.
  void run(const Plan& plan, const AttentionProblem& problem) const;
  void forward(const AttentionProblem& problem) const { run(*plan(problem), problem); }
  // The engine (Plan::engine()) of the plan this impl last ran to completion through run(), on
  // any thread (paged calls too where forward_paged plans and runs through run(), as FLASH's
  // does); empty before the first such run and for backends without engines.
  std::string last_engine() const;

  // One paged-KV call (docs/semantics.md, "Paged KV"). Throws Unsupported unless the backend
  // supports paged KV.
  virtual void forward_paged(const PagedAttentionCall& call) const;

 protected:
  virtual void run_cpu(const Plan& plan, const AttentionProblem& problem) const;
  virtual void run_cuda(const Plan& plan, const AttentionProblem& problem) const;
  virtual void run_hip(const Plan& plan, const AttentionProblem& problem) const {
    run_cuda(plan, problem);
  }
  virtual void run_musa(const Plan& plan, const AttentionProblem& problem) const {
    run_cuda(plan, problem);
  }
  virtual void run_npu(const Plan& plan, const AttentionProblem& problem) const;
  virtual void run_xpu(const Plan& plan, const AttentionProblem& problem) const;
  // Throws Unsupported naming the backend and the platform.
  [[noreturn]] void no_platform(Platform p) const;

 private:
  void dispatch(const Plan& plan, const AttentionProblem& problem) const;

  const Backend& backend_;
  ImplConfig config_;
  mutable std::mutex engine_mutex_;
  mutable std::string last_engine_;  // under engine_mutex_
};

// What a caller asks for when choosing a backend.
struct BackendRequest {
  Platform platform = Platform::cpu;
  std::int64_t head_size = 0;
  std::optional<DType> dtype;  // Q's dtype when known
  KvCacheDtype kv_cache_dtype = KvCacheDtype::unquantized;
  FeatureSet features;  // capabilities the caller needs
};

// Why a backend cannot serve a request: every reason, in the order platform, availability,
// head size, dtype, features, kv cache dtype. Empty = it can.
struct Refusal {
  std::vector<std::string> reasons;
  bool refused() const { return !reasons.empty(); }
  explicit operator bool() const { return refused(); }
  // The reasons joined by ", ".
  std::string to_string() const;
};

// A backend declares its capabilities once, as a BackendCapabilities value passed to the
// constructor (include/dattn/capabilities.hpp lists each with the feature it guards), and makes
// Impls.
class Backend;
// InvalidArgument naming the first key of `options` that `backend` does not declare
// (Backend::option_names), listing the valid ones (and the nearest, where one is a near miss);
// nothing where the backend declares none. Keys are matched exactly (no trimming, no case
// folding): callers that parse text (the CLI) trim it first.
void check_backend_options(const Backend& backend, const BackendOptions& options);

class Backend : public std::enable_shared_from_this<Backend> {
 public:
  explicit Backend(BackendCapabilities capabilities = {})
      : capabilities_(std::move(capabilities)) {}
  virtual ~Backend() = default;

  // Canonical upper-case name, e.g. "REFERENCE" (the seed's get_name).
  virtual std::string name() const = 0;
  virtual std::string description() const { return {}; }
  // Higher is preferred by automatic selection (the platform default is the highest that fits).
  virtual int priority() const { return 0; }

  const BackendCapabilities& capabilities() const { return capabilities_; }

  // ---- readers of capabilities() under the seed's names ----
  bool accept_output_buffer() const { return capabilities_.accept_output_buffer; }
  bool supports_piecewise_spans() const { return capabilities_.supports_piecewise_spans; }
  bool supports_paged_kv() const { return capabilities_.supports_paged_kv; }
  bool supports_prefix_kv_slicing() const { return capabilities_.supports_prefix_kv_slicing; }
  bool supports_packed_mask_free() const { return capabilities_.supports_packed_mask_free; }
  bool supports_multi_doc_packed_varlen() const {
    return capabilities_.supports_multi_doc_packed_varlen;
  }
  bool supports_causal() const { return capabilities_.supports_causal; }
  bool supports_dense_attention_mask() const { return capabilities_.supports_dense_attention_mask; }
  bool exact() const { return capabilities_.exact; }
  bool indexes_kv_by_block_stride() const { return capabilities_.indexes_kv_by_block_stride; }
  // nullopt = unrestricted.
  const std::optional<std::vector<Platform>>& supported_platforms() const {
    return capabilities_.supported_platforms;
  }
  bool supports_platform(Platform p) const;
  // Empty = any head size.
  const std::vector<std::int64_t>& supported_head_sizes() const {
    return capabilities_.supported_head_sizes;
  }
  bool supports_head_size(std::int64_t head_size) const;
  // Input dtypes this backend computes with (Q's dtype).
  bool supports_dtype(DType q_dtype) const;
  // `unquantized` is always supported.
  bool supports_kv_cache_dtype(KvCacheDtype dtype, Platform platform) const;

  // ---- probes that take arguments ----
  // `spec` is the per-layer backend options when the user picked a backend explicitly. By
  // default capabilities().supports_attention_mask.
  virtual bool supports_attention_mask(const BackendOptions* spec = nullptr) const {
    (void)spec;
    return capabilities_.supports_attention_mask;
  }
  // Throws NotAvailable when an optional dependency or hardware feature is missing.
  virtual void validate_available() const {}
  // Throws when the process's configuration of this backend is wrong (FLASH: DATTN_ISA names no
  // engine, InvalidArgument, or one this CPU lacks, NotAvailable). Unlike validate_available, a
  // configuration error is not a reason to skip the backend: the registry raises it under
  // automatic choice too, rather than falling through to a slower backend.
  virtual void validate_configuration() const {}

  // The seed's get_impl_cls: makes an Impl. Must not be called for a config that
  // refusal() rejects; the registry and the layer check first.
  virtual std::unique_ptr<Impl> make_impl(const ImplConfig& config) const = 0;

  // The construction options (AttentionConfig::backend_options) this backend reads, by name;
  // nullopt where it does not declare them (a backend registered from outside, whose options are
  // then not checked). A layer refuses any other key: check_backend_options below. The per-call
  // slot (extra.backend) stays tolerant.
  virtual std::optional<std::vector<std::string>> option_names() const { return std::nullopt; }

  // Whether the backend claims `f`: the capability that guards it (capability_for(f)) holds,
  // and so does that of every feature it implies.
  bool claims(Feature f, const BackendOptions* spec = nullptr) const;
  // The capabilities (by name, once each, in feature order) that `features` need and this
  // backend lacks; empty when it claims them all.
  std::vector<std::string_view> unclaimed(const FeatureSet& features,
                                          const BackendOptions* spec = nullptr) const;
  // Every reason this backend cannot serve `request` here (empty if it can).
  Refusal refusal(const BackendRequest& request, const BackendOptions* spec = nullptr) const;

 private:
  BackendCapabilities capabilities_;
};

}  // namespace dattn
