#include "dattn/attention.hpp"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <vector>

#include "core/prepare_call.hpp"
#include "core/process_memory.hpp"
#include "dattn/errors.hpp"

namespace dattn {

AttentionRole parse_attention_role(std::string_view s) {
  if (names_equal(s, "self")) return AttentionRole::self;
  if (names_equal(s, "cross")) return AttentionRole::cross;
  throw InvalidArgument("role", "role = '" + std::string(s) + "' is not valid; valid: self, cross");
}

std::string_view attention_role_name(AttentionRole r) {
  return r == AttentionRole::self ? "self" : "cross";
}

namespace {

bool verbose() {
  const char* v = std::getenv("DATTN_VERBOSE");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// An impl with the plans of its last few call shapes (every denoising step repeats them; a
// sequence-parallel call runs a handful of shapes in turn).
struct ImplSlot {
  static constexpr std::size_t kPlans = 8;
  std::shared_ptr<const Backend> backend;
  std::unique_ptr<Impl> impl;
  std::mutex plan_mutex;
  std::vector<std::shared_ptr<const Plan>> plans;  // most recently used last

  std::shared_ptr<const Plan> plan_for(const AttentionProblem& p) {
    std::lock_guard lock(plan_mutex);
    for (std::size_t i = plans.size(); i-- > 0;)
      if (plans[i]->signature() == p.signature) {
        std::shared_ptr<const Plan> hit = plans[i];
        plans.erase(plans.begin() + std::ptrdiff_t(i));
        plans.push_back(hit);
        return hit;
      }
    std::shared_ptr<const Plan> plan = impl->plan(p);
    if (verbose())
      std::cerr << "dattn: " << backend->name() << " planned " << p.describe() << ": "
                << plan->to_string() << '\n';
    if (plans.size() == kPlans) plans.erase(plans.begin());
    plans.push_back(plan);
    return plan;
  }
};

}  // namespace

// One live layer of the process for the State's lifetime (the last one gone empties the process's
// idle buffers: include/dattn/memory.hpp).
struct LiveLayer {
  LiveLayer() { detail::ProcessMemory::instance().layer_created(); }
  ~LiveLayer() { detail::ProcessMemory::instance().layer_destroyed(); }
  LiveLayer(const LiveLayer&) = delete;
  LiveLayer& operator=(const LiveLayer&) = delete;
};

struct Attention::State {
  LiveLayer live;
  AttentionConfig config;
  double scale = 1.0;
  std::int64_t num_kv_heads = 0;
  const Registry* registry = nullptr;
  Selection selection;
  bool automatic = false;
  BackendRequest request;
  std::unique_ptr<ImplSlot> primary;
  std::mutex fallback_mutex;
  std::map<std::string, std::unique_ptr<ImplSlot>> fallbacks;
  // The impl that ran the latest call (slots live as long as the layer).
  std::atomic<const Impl*> last_impl{nullptr};

  // `fallback`: the slot serves calls the chosen backend lacks a feature for; the options meant
  // for the chosen backend's engines (isa, compute_dtype) are not passed on to it.
  std::unique_ptr<ImplSlot> make_slot(std::shared_ptr<const Backend> backend,
                                      bool fallback = false) const {
    ImplConfig ic;
    ic.num_heads = config.num_heads;
    ic.head_size = config.head_size;
    ic.softmax_scale = scale;
    ic.causal = config.causal;
    ic.num_kv_heads = num_kv_heads;
    ic.prefix = config.prefix;
    ic.qkv_layout = config.qkv_layout;
    ic.backend_kwargs = config.backend_options;
    if (fallback)
      for (const char* key : {"isa", "compute_dtype"}) ic.backend_kwargs.erase(key);
    ic.kv_cache_dtype = config.kv_cache_dtype;
    ic.platform = config.platform;
    auto slot = std::make_unique<ImplSlot>();
    slot->impl = backend->make_impl(ic);
    slot->backend = std::move(backend);
    return slot;
  }

  // The impl that serves a call needing `features`: the chosen backend if it claims them all;
  // under automatic choice the best backend that does; otherwise Unsupported.
  ImplSlot& slot_for(const FeatureSet& features) {
    const Backend& chosen = *primary->backend;
    const BackendOptions* spec = &config.backend_options;
    const std::vector<std::string_view> missing = chosen.unclaimed(features, spec);
    if (missing.empty()) return *primary;
    std::string names;
    for (std::string_view m : missing) names += (names.empty() ? "" : ", ") + std::string(m);
    if (!automatic && !config.allow_fallback)
      throw Unsupported(std::string(missing.front()),
                        "backend " + chosen.name() + " does not support this call: it needs " +
                            names + " (" + selection.source +
                            " choice; pick a backend that claims it, e.g. REFERENCE)");
    BackendRequest r = request;
    r.features = features;
    std::lock_guard lock(fallback_mutex);
    for (const auto& b : registry->all()) {
      if (!b->exact() || b->refusal(r, spec)) continue;
      auto& slot = fallbacks[b->name()];
      if (!slot) slot = make_slot(b, /*fallback=*/true);
      if (verbose())
        std::cerr << "dattn: " << chosen.name() << " lacks " << names << "; this call runs on "
                  << b->name() << '\n';
      return *slot;
    }
    throw Unsupported(
        std::string(missing.front()),
        "no registered backend supports this call's features: " + features.to_string());
  }

  // Runs one call on this process with `cfg` (the layer's config, or a strategy's block of its
  // heads); returns the backend that ran it.
  const Backend& run_local(const AttentionInputs& in, const AttentionConfig& cfg,
                           std::int64_t kv_heads) {
    const bool mask_free = primary->backend->supports_packed_mask_free();
    detail::PrepareOptions opts;
    opts.honour_packed_padding = mask_free;
    detail::PreparedCall call = detail::prepare_call(cfg, scale, kv_heads, in, opts);
    ImplSlot* slot = &slot_for(call.problem.features);
    if (slot->backend->supports_packed_mask_free() != mask_free) {
      // The fallback treats packed_padding differently (docs/semantics.md, "Packed padding and
      // prefix slicing"): resolve again for it.
      opts.honour_packed_padding = slot->backend->supports_packed_mask_free();
      call = detail::prepare_call(cfg, scale, kv_heads, in, opts);
      slot = &slot_for(call.problem.features);
    }
    AttentionProblem& p = call.problem;
    if (p.kv_cache_dtype != config.kv_cache_dtype &&
        !slot->impl->supports_kv_cache_dtype(p.kv_cache_dtype, p.q.platform()))
      throw Unsupported("kv_cache_dtype", "backend " + slot->backend->name() +
                                              " does not support kv_cache_dtype " +
                                              std::string(kv_cache_dtype_name(p.kv_cache_dtype)) +
                                              " on " + std::string(platform_name(p.q.platform())));
    if (slot->backend->accept_output_buffer()) {
      slot->impl->run(*slot->plan_for(p), p);
      last_impl = slot->impl.get();
      return *slot->backend;
    }
    // The backend writes only into a buffer of its own: give it one, then copy.
    const TensorView caller_out = p.out;
    Tensor tmp = Tensor::zeros(caller_out.shape(), caller_out.dtype());
    p.out = tmp.view();
    slot->impl->run(*slot->plan_for(p), p);
    last_impl = slot->impl.get();
    copy_into(tmp.view(), caller_out);
    return *slot->backend;
  }
};

Attention::Attention(AttentionConfig config) : state_(std::make_unique<State>()) {
  State& s = *state_;
  if (config.num_heads <= 0)
    throw InvalidArgument("num_heads",
                          "num_heads = " + std::to_string(config.num_heads) + " must be positive");
  if (config.head_size <= 0)
    throw InvalidArgument("head_size",
                          "head_size = " + std::to_string(config.head_size) + " must be positive");
  s.num_kv_heads = config.num_kv_heads.value_or(config.num_heads);
  if (s.num_kv_heads <= 0 || config.num_heads % s.num_kv_heads != 0)
    throw InvalidArgument("num_kv_heads", "num_heads = " + std::to_string(config.num_heads) +
                                              " must be a multiple of num_kv_heads = " +
                                              std::to_string(s.num_kv_heads));
  s.scale = config.softmax_scale.value_or(1.0 / std::sqrt(double(config.head_size)));
  if (!std::isfinite(s.scale))
    throw InvalidArgument("softmax_scale", "softmax_scale must be finite");
  if (config.dtype && !is_float_input_dtype(*config.dtype))
    throw InvalidArgument("dtype", "dtype " + std::string(dtype_name(*config.dtype)) +
                                       " is not valid; valid: f32, bf16, f16");
  s.registry = config.registry ? config.registry : &Registry::global();
  s.request.platform = config.platform;
  s.request.head_size = config.head_size;
  s.request.dtype = config.dtype;
  s.request.kv_cache_dtype = config.kv_cache_dtype;
  s.selection = s.registry->select(s.request, config.backend, &config.backend_options);
  s.automatic = s.selection.source == "auto";
  s.config = std::move(config);
  s.primary = s.make_slot(s.selection.backend);  // its own checks first (they say more)
  check_backend_options(*s.selection.backend, s.config.backend_options);
  if (!s.primary->impl->supports_kv_cache_dtype(s.config.kv_cache_dtype, s.config.platform))
    throw Unsupported("kv_cache_dtype",
                      "backend " + s.selection.backend->name() +
                          " does not support kv_cache_dtype " +
                          std::string(kv_cache_dtype_name(s.config.kv_cache_dtype)) + " on " +
                          std::string(platform_name(s.config.platform)));
  if (verbose())
    std::cerr << "dattn: layer '" << s.config.prefix << "' uses " << s.selection.to_string()
              << '\n';
}

Attention::~Attention() = default;
Attention::Attention(Attention&&) noexcept = default;
Attention& Attention::operator=(Attention&&) noexcept = default;

const Backend& Attention::backend() const {
  return *state_->primary->backend;
}
const Impl& Attention::impl() const {
  return *state_->primary->impl;
}
const AttentionConfig& Attention::config() const {
  return state_->config;
}
const Selection& Attention::selection() const {
  return state_->selection;
}
std::string Attention::last_engine() const {
  const Impl* impl = state_->last_impl.load();
  return impl != nullptr ? impl->last_engine() : std::string();
}

const Backend& Attention::forward_into(const TensorView& q, const TensorView& k,
                                       const TensorView& v, const AttentionMetadata& metadata,
                                       const TensorView& out,
                                       const std::optional<TensorView>& lse) const {
  State& s = *state_;
  const detail::ProcessMemory::CallScope in_flight;
  const AttentionInputs inputs{q, k, v, &metadata, out, lse};
  if (!s.config.parallel) return s.run_local(inputs, s.config, s.num_kv_heads);
  const ParallelContext context{s.config.qkv_layout, s.config.num_heads, s.num_kv_heads,
                                s.config.causal, s.config.role == AttentionRole::cross};
  const Backend* ran = s.primary->backend.get();
  s.config.parallel->forward(inputs, context, [&s, &ran](const LocalCall& c) {
    AttentionConfig cfg = s.config;
    cfg.qkv_layout = c.layout;
    cfg.num_heads = c.num_heads;
    cfg.num_kv_heads = c.num_kv_heads;
    if (c.validate_only) {
      // Validate only, as the call would be prepared; nothing is built or written.
      detail::PrepareOptions opts;
      opts.honour_packed_padding = s.primary->backend->supports_packed_mask_free();
      opts.materialize = false;
      const detail::PreparedCall call =
          detail::prepare_call(cfg, s.scale, c.num_kv_heads, c.inputs, opts);
      (void)s.slot_for(call.problem.features);
      return;
    }
    ran = &s.run_local(c.inputs, cfg, c.num_kv_heads);
  });
  return *ran;
}

ForwardResult Attention::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const AttentionMetadata& metadata, bool want_lse) const {
  const QkvLayout layout = state_->config.qkv_layout;
  const int want_rank = layout == QkvLayout::THD ? 3 : 4;
  for (const auto& [t, name] : {std::pair{&q, "query"}, std::pair{&v, "value"}})
    if (t->ndim() != want_rank)
      throw InvalidArgument(name, std::string(name) + ": expected rank " +
                                      std::to_string(want_rank) + " for layout " +
                                      std::string(qkv_layout_name(layout)) + ", got " +
                                      t->describe());
  std::int64_t joint = 0;
  if (metadata.joint_query && metadata.joint_query->ndim() == want_rank)
    joint = metadata.joint_query->size(layout == QkvLayout::BHSD  ? 2
                                       : layout == QkvLayout::THD ? 0
                                                                  : 1);
  ForwardResult r;
  const std::int64_t dv = v.size(want_rank - 1);
  std::int64_t batch = 1, rows = 0, heads = 0;
  switch (layout) {
    case QkvLayout::BSHD:
      batch = q.size(0), rows = q.size(1) + joint, heads = q.size(2);
      r.out = Tensor::zeros({batch, rows, heads, dv}, q.dtype());
      break;
    case QkvLayout::BHSD:
      batch = q.size(0), rows = q.size(2) + joint, heads = q.size(1);
      r.out = Tensor::zeros({batch, heads, rows, dv}, q.dtype());
      break;
    case QkvLayout::THD:
      rows = q.size(0) + joint, heads = q.size(1);
      r.out = Tensor::zeros({rows, heads, dv}, q.dtype());
      break;
  }
  std::optional<TensorView> lse_view;
  if (want_lse) {
    r.lse = layout == QkvLayout::THD ? Tensor::zeros({heads, rows}, DType::F32)
                                     : Tensor::zeros({batch, heads, rows}, DType::F32);
    lse_view = r.lse->view();
  }
  forward_into(q, k, v, metadata, r.out.view(), lse_view);
  return r;
}

void Attention::forward_paged(const PagedAttentionCall& call) const {
  State& s = *state_;
  const detail::ProcessMemory::CallScope in_flight;
  if (!s.primary->backend->supports_paged_kv())
    throw Unsupported("supports_paged_kv", "backend " + s.primary->backend->name() +
                                               " does not support paged KV attention");
  s.primary->impl->forward_paged(call);
  s.last_impl = s.primary->impl.get();
}

}  // namespace dattn
