// What a backend can do, as data (docs/semantics.md, "Capabilities and selection"): one
// BackendCapabilities value per backend, and one table that lists every capability once under
// the seed's name, with the call feature it guards and how to read it. The registry's refusal,
// the layer's feature checks, `dattn info`, the conformance suite and the Python layer all read
// capabilities through this table.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <variant>
#include <vector>

#include "dattn/dtype.hpp"
#include "dattn/metadata.hpp"
#include "dattn/problem.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

class Backend;

// A backend's static capabilities, under the seed's names. A backend passes its value to
// Backend's constructor; Backend's readers of the same names return its members.
struct BackendCapabilities {
  bool accept_output_buffer = false;  // writes into the caller's (strided) output
  bool supports_piecewise_spans = false;
  bool supports_paged_kv = false;
  bool supports_prefix_kv_slicing = false;
  bool supports_packed_mask_free = false;
  bool supports_multi_doc_packed_varlen = false;
  // What supports_attention_mask(spec) answers unless a backend overrides that probe.
  bool supports_attention_mask = false;
  // dattn's own flags (not in the seed): every dense backend serves causal calls and 3-D/4-D
  // masks; a sparse backend may not.
  bool supports_causal = true;
  bool supports_dense_attention_mask = true;
  // False for a backend that approximates attention (block-sparse): automatic choice and
  // automatic fallback never pick it; only an explicit choice does.
  bool exact = true;
  bool indexes_kv_by_block_stride = false;
  // nullopt = every platform.
  std::optional<std::vector<Platform>> supported_platforms;
  // Empty = any head size.
  std::vector<std::int64_t> supported_head_sizes;
  // Input dtypes this backend computes with (Q's dtype).
  std::vector<DType> supported_dtypes{DType::F32, DType::BF16, DType::F16};
  // Quantized KV cache dtypes per platform (the seed's _supported_kv_cache_dtypes);
  // `unquantized` is always supported.
  std::map<Platform, std::vector<KvCacheDtype>> kv_cache_dtypes;
};

// The value of one capability.
using CapabilityValue =
    std::variant<bool, std::optional<std::vector<Platform>>, std::vector<std::int64_t>,
                 std::vector<DType>, std::map<Platform, std::vector<KvCacheDtype>>>;

enum class CapabilityKind : std::uint8_t {
  flag,   // a bool member of BackendCapabilities
  list,   // a non-bool member of BackendCapabilities (platforms, head sizes, dtypes)
  probe,  // a call that takes arguments: supports_attention_mask(spec),
          // supports_kv_cache_dtype(dtype, platform); read() gives its answer without them
          // (spec = null) or the data it consults
};

struct Capability {
  std::string_view name;  // the seed's name, e.g. "supports_paged_kv"; a `dattn info` key
  CapabilityKind kind;
  // The call feature this capability guards: a call that uses it needs the capability true.
  std::optional<Feature> feature;
  // The member of BackendCapabilities it is (null for a probe).
  bool BackendCapabilities::*flag = nullptr;
  // Reads the capability of `backend`; `spec` is the per-layer backend options, if any.
  CapabilityValue (*read)(const Backend& backend, const BackendOptions* spec) = nullptr;
  // A feature that a call using `feature` uses as well, whose capability must hold too (a dense
  // mask is a mask: supports_dense_attention_mask counts only with supports_attention_mask).
  std::optional<Feature> implies;
};

// Every capability, once, in the order `dattn info` prints them.
std::span<const Capability> capability_table();
// The entry called `name`, or null.
const Capability* find_capability(std::string_view name);
// The entry that guards `f`, or null (lse_output is always supported).
const Capability* capability_for(Feature f);

}  // namespace dattn
