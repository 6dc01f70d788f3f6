#include "dattn/backend.hpp"

#include <algorithm>
#include <cctype>

#include "dattn/errors.hpp"

namespace dattn {

QkvLayout parse_qkv_layout(std::string_view s) {
  std::string v(s);
  std::transform(v.begin(), v.end(), v.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (v == "BSHD") return QkvLayout::BSHD;
  if (v == "BHSD") return QkvLayout::BHSD;
  if (v == "THD") return QkvLayout::THD;
  throw InvalidArgument(
      "qkv_layout", "qkv_layout = '" + std::string(s) + "' is not valid; valid: BSHD, BHSD, THD");
}

std::string_view qkv_layout_name(QkvLayout l) {
  switch (l) {
    case QkvLayout::BSHD:
      return "BSHD";
    case QkvLayout::BHSD:
      return "BHSD";
    case QkvLayout::THD:
      return "THD";
  }
  return "?";
}

Impl::Impl(const Backend& backend, ImplConfig config)
    : backend_(backend), config_(std::move(config)) {}

bool Impl::supports_kv_cache_dtype(KvCacheDtype dtype, Platform platform) const {
  if (dtype == KvCacheDtype::unquantized) return true;
  const auto table = supported_kv_cache_dtypes();
  const auto it = table.find(platform);
  return it != table.end() &&
         std::find(it->second.begin(), it->second.end(), dtype) != it->second.end();
}

void Impl::run(const Plan& plan, const AttentionProblem& problem) const {
  if (plan.signature() != problem.signature)
    throw InvalidArgument("plan", backend_.name() +
                                      ": the plan was made for other shapes or metadata than "
                                      "this call (" +
                                      problem.describe() + "); plan again");
  switch (problem.q.platform()) {
    case Platform::cpu:
      return run_cpu(plan, problem);
    case Platform::cuda:
      return run_cuda(plan, problem);
    case Platform::rocm:
      return run_hip(plan, problem);
    case Platform::musa:
      return run_musa(plan, problem);
    case Platform::npu:
      return run_npu(plan, problem);
    case Platform::xpu:
      return run_xpu(plan, problem);
  }
  no_platform(problem.q.platform());
}

void Impl::no_platform(Platform p) const {
  throw Unsupported("platform", "backend " + backend_.name() +
                                    " has no implementation for platform " +
                                    std::string(platform_name(p)));
}

void Impl::run_cpu(const Plan&, const AttentionProblem&) const {
  no_platform(Platform::cpu);
}
void Impl::run_cuda(const Plan&, const AttentionProblem& p) const {
  no_platform(p.q.platform());
}
void Impl::run_npu(const Plan&, const AttentionProblem&) const {
  no_platform(Platform::npu);
}
void Impl::run_xpu(const Plan&, const AttentionProblem&) const {
  no_platform(Platform::xpu);
}

void Impl::forward_paged(const PagedAttentionCall&) const {
  throw Unsupported("supports_paged_kv",
                    "backend " + backend_.name() + " does not support paged KV attention");
}

bool Backend::supports_head_size(std::int64_t head_size) const {
  const auto sizes = supported_head_sizes();
  return sizes.empty() || std::find(sizes.begin(), sizes.end(), head_size) != sizes.end();
}

bool Backend::claims(Feature f, const BackendOptions* spec) const {
  switch (f) {
    case Feature::attention_mask:
      return supports_attention_mask(spec);
    case Feature::multi_doc_packed_varlen:
      return supports_multi_doc_packed_varlen();
    case Feature::packed_mask_free:
      return supports_packed_mask_free();
    case Feature::prefix_kv_slicing:
      return supports_prefix_kv_slicing();
    case Feature::piecewise_spans:
      return supports_piecewise_spans();
    case Feature::paged_kv:
      return supports_paged_kv();
    case Feature::lse_output:
      return true;
    case Feature::causal:
      return supports_causal();
    case Feature::dense_attention_mask:
      return supports_attention_mask(spec) && supports_dense_attention_mask();
  }
  return false;
}

std::optional<std::string> Backend::refusal(const BackendRequest& request,
                                            const BackendOptions* spec) const {
  if (const auto platforms = supported_platforms();
      platforms &&
      std::find(platforms->begin(), platforms->end(), request.platform) == platforms->end())
    return "does not run on platform " + std::string(platform_name(request.platform));
  try {
    validate_available();
  } catch (const std::exception& e) {
    return std::string("not available: ") + e.what();
  }
  if (request.head_size > 0 && !supports_head_size(request.head_size))
    return "head size " + std::to_string(request.head_size) + " is not supported";
  if (request.dtype && !supports_dtype(*request.dtype))
    return "dtype " + std::string(dtype_name(*request.dtype)) + " is not supported";
  for (Feature f : request.features.list())
    if (!claims(f, spec)) return "does not support " + std::string(feature_name(f));
  if (request.kv_cache_dtype != KvCacheDtype::unquantized) {
    ImplConfig probe;
    probe.num_heads = 1;
    probe.head_size = request.head_size > 0 ? request.head_size : 64;
    probe.num_kv_heads = 1;
    probe.platform = request.platform;
    if (!make_impl(probe)->supports_kv_cache_dtype(request.kv_cache_dtype, request.platform))
      return "kv_cache_dtype " + std::string(kv_cache_dtype_name(request.kv_cache_dtype)) +
             " is not supported on " + std::string(platform_name(request.platform));
  }
  return std::nullopt;
}

}  // namespace dattn
