#include "dattn/registry.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "core/builtin_backends.hpp"
#include "dattn/errors.hpp"

namespace dattn {

bool names_equal(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](unsigned char x, unsigned char y) {
           return std::tolower(x) == std::tolower(y);
         });
}

std::string Selection::to_string() const {
  std::string s = (backend ? backend->name() : std::string("<none>")) + " (" + source + ")";
  for (const std::string& r : skipped) s += "; skipped " + r;
  return s;
}

Registry& Registry::global() {
  static Registry* registry = [] {
    auto* r = new Registry();
    register_builtin_backends(*r);
    return r;
  }();
  return *registry;
}

void Registry::add(std::shared_ptr<const Backend> backend) {
  if (!backend) throw InvalidArgument("backend", "cannot register a null backend");
  const std::string name = backend->name();
  if (name.empty()) throw InvalidArgument("backend", "a backend needs a non-empty name");
  std::lock_guard lock(mutex_);
  for (const auto& b : backends_)
    if (names_equal(b->name(), name))
      throw InvalidArgument("backend", "a backend named '" + name + "' is already registered");
  backends_.push_back(std::move(backend));
  std::stable_sort(backends_.begin(), backends_.end(),
                   [](const auto& a, const auto& b) { return a->priority() > b->priority(); });
}

bool Registry::remove(std::string_view name) {
  std::lock_guard lock(mutex_);
  const auto it = std::find_if(backends_.begin(), backends_.end(),
                               [&](const auto& b) { return names_equal(b->name(), name); });
  if (it == backends_.end()) return false;
  backends_.erase(it);
  return true;
}

std::vector<std::shared_ptr<const Backend>> Registry::all() const {
  std::lock_guard lock(mutex_);
  return backends_;
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (const auto& b : all()) out.push_back(b->name());
  return out;
}

std::shared_ptr<const Backend> Registry::find(std::string_view name) const {
  for (const auto& b : all())
    if (names_equal(b->name(), name)) return b;
  std::string valid;
  for (const std::string& n : names()) valid += (valid.empty() ? "" : ", ") + n;
  throw InvalidArgument("backend", "unknown attention backend '" + std::string(name) +
                                       "'; valid: " + valid + " (or auto)");
}

Selection Registry::select(const BackendRequest& request,
                           std::optional<std::string_view> explicit_name,
                           const BackendOptions* spec) const {
  std::optional<std::string> chosen;
  std::string source;
  if (explicit_name && !explicit_name->empty() && !names_equal(*explicit_name, "auto")) {
    chosen = std::string(*explicit_name);
    source = "explicit";
  } else if (const char* env = std::getenv("DIFFUSION_ATTENTION_BACKEND");
             env != nullptr && *env != '\0' && !names_equal(env, "auto")) {
    chosen = std::string(env);
    source = "env DIFFUSION_ATTENTION_BACKEND";
  }
  Selection sel;
  if (chosen) {
    sel.backend = find(*chosen);
    sel.source = source;
    if (!sel.backend->supports_platform(request.platform))
      throw NotAvailable("backend", "backend " + sel.backend->name() + " (" + source +
                                        ") does not run on platform " +
                                        std::string(platform_name(request.platform)));
    sel.backend->validate_configuration();
    sel.backend->validate_available();
    if (const Refusal why = sel.backend->refusal(request, spec))
      throw Unsupported("backend", "backend " + sel.backend->name() + " (" + source +
                                       ") cannot serve this layer: " + why.to_string());
    return sel;
  }
  sel.source = "auto";
  for (const auto& b : all()) {
    b->validate_configuration();  // a configuration error raises: never a silent fall-through
    if (!b->exact()) {
      sel.skipped.push_back(b->name() + ": approximate; chosen only explicitly");
      continue;
    }
    if (const Refusal why = b->refusal(request, spec)) {
      sel.skipped.push_back(b->name() + ": " + why.to_string());
      continue;
    }
    sel.backend = b;
    return sel;
  }
  std::string reasons;
  for (const std::string& r : sel.skipped) reasons += "; " + r;
  throw Unsupported("backend", "no registered backend can serve this request" + reasons);
}

}  // namespace dattn
