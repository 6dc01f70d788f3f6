// The backend contract (docs/semantics.md, "Capabilities and selection"): a Backend declares
// capabilities and makes Impls; an Impl plans and runs calls on the platform where the tensors
// live.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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

  // Per-platform quantized KV dtypes (the seed's _supported_kv_cache_dtypes).
  virtual std::map<Platform, std::vector<KvCacheDtype>> supported_kv_cache_dtypes() const {
    return {};
  }
  // `unquantized` is always supported.
  bool supports_kv_cache_dtype(KvCacheDtype dtype, Platform platform) const;

  // Shapes and metadata -> plan (the seed's metadata builder).
  virtual std::unique_ptr<Plan> plan(const AttentionProblem& problem) const = 0;
  // Runs `plan` on `problem` (same signature), dispatching on the platform of Q:
  // cpu -> run_cpu, cuda -> run_cuda, rocm -> run_hip (defaults to cuda), musa -> run_musa
  // (defaults to cuda), npu -> run_npu, xpu -> run_xpu.
  void run(const Plan& plan, const AttentionProblem& problem) const;
  void forward(const AttentionProblem& problem) const { run(*plan(problem), problem); }

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
  const Backend& backend_;
  ImplConfig config_;
};

// What a caller asks for when choosing a backend.
struct BackendRequest {
  Platform platform = Platform::cpu;
  std::int64_t head_size = 0;
  std::optional<DType> dtype;  // Q's dtype when known
  KvCacheDtype kv_cache_dtype = KvCacheDtype::unquantized;
  FeatureSet features;  // capabilities the caller needs
};

class Backend : public std::enable_shared_from_this<Backend> {
 public:
  virtual ~Backend() = default;

  // Canonical upper-case name, e.g. "REFERENCE" (the seed's get_name).
  virtual std::string name() const = 0;
  virtual std::string description() const { return {}; }
  // Higher is preferred by automatic selection (the platform default is the highest that fits).
  virtual int priority() const { return 0; }

  // ---- capability flags and probes (seed names) ----
  virtual bool accept_output_buffer() const { return false; }
  virtual bool supports_piecewise_spans() const { return false; }
  virtual bool supports_paged_kv() const { return false; }
  virtual bool supports_prefix_kv_slicing() const { return false; }
  virtual bool supports_packed_mask_free() const { return false; }
  virtual bool supports_multi_doc_packed_varlen() const { return false; }
  // nullopt = unrestricted.
  virtual std::optional<std::vector<Platform>> supported_platforms() const { return std::nullopt; }
  // Throws NotAvailable when an optional dependency or hardware feature is missing.
  virtual void validate_available() const {}
  // `spec` is the per-layer backend options when the user picked a backend explicitly.
  virtual bool supports_attention_mask(const BackendOptions* spec = nullptr) const {
    (void)spec;
    return false;
  }
  // dattn's own flags (not in the seed): every dense backend serves causal calls and 3-D/4-D
  // masks; a sparse backend may not.
  virtual bool supports_causal() const { return true; }
  virtual bool supports_dense_attention_mask() const { return true; }
  // False for a backend that approximates attention (block-sparse): automatic choice and
  // automatic fallback never pick it; only an explicit choice does.
  virtual bool exact() const { return true; }
  // Empty = any head size.
  virtual std::vector<std::int64_t> supported_head_sizes() const { return {}; }
  bool supports_head_size(std::int64_t head_size) const;
  virtual bool indexes_kv_by_block_stride() const { return false; }
  // Input dtypes this backend computes with (Q's dtype); default f32, bf16, f16.
  virtual bool supports_dtype(DType q_dtype) const { return is_float_input_dtype(q_dtype); }

  // The seed's get_impl_cls: makes an Impl. Must not be called for a config that
  // refusal() rejects; the registry and the layer check first.
  virtual std::unique_ptr<Impl> make_impl(const ImplConfig& config) const = 0;

  // Whether the backend claims `f`.
  bool claims(Feature f, const BackendOptions* spec = nullptr) const;
  // Why this backend cannot serve `request` here, or nullopt if it can.
  std::optional<std::string> refusal(const BackendRequest& request,
                                     const BackendOptions* spec = nullptr) const;
};

}  // namespace dattn
