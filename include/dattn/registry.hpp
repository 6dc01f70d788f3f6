// Backend registry and selection (docs/semantics.md, "Capabilities and selection").
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dattn/backend.hpp"

namespace dattn {

// The outcome of choosing a backend, with the reasons others were skipped.
struct Selection {
  std::shared_ptr<const Backend> backend;
  std::string source;                // "explicit", "env DIFFUSION_ATTENTION_BACKEND" or "auto"
  std::vector<std::string> skipped;  // "NAME: reason" for each backend passed over
  std::string to_string() const;
};

class Registry {
 public:
  // The process-wide registry, holding the built-in backends.
  static Registry& global();
  // An empty registry (tests, embedding).
  Registry() = default;

  // Registers a backend at run time. Throws InvalidArgument if the name is taken.
  void add(std::shared_ptr<const Backend> backend);
  // Removes a run-time backend; returns whether it was there.
  bool remove(std::string_view name);
  // Case-insensitive lookup. Throws InvalidArgument listing the valid names.
  std::shared_ptr<const Backend> find(std::string_view name) const;
  // Every backend, highest priority first.
  std::vector<std::shared_ptr<const Backend>> all() const;
  std::vector<std::string> names() const;

  // Precedence: `explicit_name` (if set and not "auto") > env DIFFUSION_ATTENTION_BACKEND
  // (unless unset, empty or "auto") > the highest-priority backend that serves `request`.
  // An explicit or env choice that cannot serve the request throws (NotAvailable or
  // Unsupported) with the reason; automatic choice skips such backends and, when none fits,
  // throws Unsupported listing every backend's reason.
  Selection select(const BackendRequest& request, std::optional<std::string_view> explicit_name,
                   const BackendOptions* spec = nullptr) const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<const Backend>> backends_;
};

// Case-insensitive name comparison used throughout.
bool names_equal(std::string_view a, std::string_view b);

}  // namespace dattn
