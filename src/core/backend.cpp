#include "dattn/backend.hpp"

#include <algorithm>
#include <cctype>
#include <variant>

#include "dattn/errors.hpp"

namespace dattn {

namespace {
// The edit distance of a and b (insertions, deletions, substitutions; small strings).
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}
}  // namespace

void check_backend_options(const Backend& backend, const BackendOptions& options) {
  const std::optional<std::vector<std::string>> names = backend.option_names();
  if (!names) return;
  for (const auto& [key, value] : options) {
    if (std::find(names->begin(), names->end(), key) != names->end()) continue;
    std::string valid, nearest;
    std::size_t best = 3;  // a near miss: at most two edits (or the same words, spaced)
    for (const std::string& n : *names) {
      valid += (valid.empty() ? "" : ", ") + n;
      std::string trimmed(key);
      trimmed.erase(0, trimmed.find_first_not_of(" \t"));
      trimmed.erase(trimmed.find_last_not_of(" \t") + 1);
      const std::size_t dist = trimmed == n ? 0 : edit_distance(key, n);
      if (dist < best) best = dist, nearest = n;
    }
    throw InvalidArgument(
        key, "backend option '" + key + "' is not an option of " + backend.name() +
                 (valid.empty() ? " (it takes none)" : "; valid: " + valid) +
                 (nearest.empty() ? std::string() : " (did you mean '" + nearest + "'?)"));
  }
}

QkvLayout parse_qkv_layout(std::string_view s) {
  std::string v(s);
  std::transform(v.begin(), v.end(), v.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  // BSND / BNSD: the same layouts as vllm-omni's video models name them (N: heads).
  if (v == "BSHD" || v == "BSND") return QkvLayout::BSHD;
  if (v == "BHSD" || v == "BNSD") return QkvLayout::BHSD;
  if (v == "THD") return QkvLayout::THD;
  throw InvalidArgument("qkv_layout", "qkv_layout = '" + std::string(s) +
                                          "' is not valid; valid: BSHD (or BSND), BHSD (or BNSD), "
                                          "THD");
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

std::map<Platform, std::vector<KvCacheDtype>> Impl::supported_kv_cache_dtypes() const {
  return backend_.capabilities().kv_cache_dtypes;
}

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
  dispatch(plan, problem);
  std::string engine = plan.engine();
  const std::lock_guard lock(engine_mutex_);
  last_engine_ = std::move(engine);
}

std::string Impl::last_engine() const {
  const std::lock_guard lock(engine_mutex_);
  return last_engine_;
}

void Impl::dispatch(const Plan& plan, const AttentionProblem& problem) const {
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

namespace {

template <typename T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

std::string Refusal::to_string() const {
  std::string s;
  for (const std::string& r : reasons) s += (s.empty() ? "" : ", ") + r;
  return s;
}

bool Backend::supports_platform(Platform p) const {
  const auto& platforms = supported_platforms();
  return !platforms || contains(*platforms, p);
}

bool Backend::supports_head_size(std::int64_t head_size) const {
  const auto& sizes = supported_head_sizes();
  return sizes.empty() || contains(sizes, head_size);
}

bool Backend::supports_dtype(DType q_dtype) const {
  return contains(capabilities_.supported_dtypes, q_dtype);
}

bool Backend::supports_kv_cache_dtype(KvCacheDtype dtype, Platform platform) const {
  if (dtype == KvCacheDtype::unquantized) return true;
  const auto it = capabilities_.kv_cache_dtypes.find(platform);
  return it != capabilities_.kv_cache_dtypes.end() && contains(it->second, dtype);
}

bool Backend::claims(Feature f, const BackendOptions* spec) const {
  FeatureSet one;
  one.add(f);
  return unclaimed(one, spec).empty();
}

std::vector<std::string_view> Backend::unclaimed(const FeatureSet& features,
                                                 const BackendOptions* spec) const {
  std::vector<std::string_view> out;
  for (Feature f : features.list())
    for (const Capability* c = capability_for(f); c != nullptr;
         c = c->implies ? capability_for(*c->implies) : nullptr)
      if (!std::get<bool>(c->read(*this, spec)) && !contains(out, c->name)) out.push_back(c->name);
  return out;
}

Refusal Backend::refusal(const BackendRequest& request, const BackendOptions* spec) const {
  Refusal r;
  if (!supports_platform(request.platform))
    r.reasons.push_back("does not run on platform " + std::string(platform_name(request.platform)));
  try {
    validate_available();
  } catch (const std::exception& e) {
    r.reasons.push_back(std::string("not available: ") + e.what());
  }
  if (request.head_size > 0 && !supports_head_size(request.head_size))
    r.reasons.push_back("head size " + std::to_string(request.head_size) + " is not supported");
  if (request.dtype && !supports_dtype(*request.dtype))
    r.reasons.push_back("dtype " + std::string(dtype_name(*request.dtype)) + " is not supported");
  for (std::string_view capability : unclaimed(request.features, spec))
    r.reasons.push_back("does not support " + std::string(capability));
  if (!supports_kv_cache_dtype(request.kv_cache_dtype, request.platform))
    r.reasons.push_back("kv_cache_dtype " +
                        std::string(kv_cache_dtype_name(request.kv_cache_dtype)) +
                        " is not supported on " + std::string(platform_name(request.platform)));
  return r;
}

}  // namespace dattn
