#include "dattn/capabilities.hpp"

#include <array>

#include "dattn/backend.hpp"

namespace dattn {

namespace {

template <auto Member>
CapabilityValue read_member(const Backend& b, const BackendOptions*) {
  return b.capabilities().*Member;
}

template <bool BackendCapabilities::*Member>
constexpr Capability flag(std::string_view name, std::optional<Feature> feature = std::nullopt,
                          std::optional<Feature> implies = std::nullopt) {
  return {name, CapabilityKind::flag, feature, Member, &read_member<Member>, implies};
}

template <auto Member>
constexpr Capability list(std::string_view name) {
  return {name, CapabilityKind::list, std::nullopt, nullptr, &read_member<Member>, std::nullopt};
}

CapabilityValue read_attention_mask(const Backend& b, const BackendOptions* spec) {
  return b.supports_attention_mask(spec);
}

using C = BackendCapabilities;

// The one list of capabilities. A new capability is a member of BackendCapabilities and a row
// here; `dattn info`, the Python layer, the registry and the conformance suite follow.
constexpr std::array<Capability, 15> kTable{{
    flag<&C::accept_output_buffer>("accept_output_buffer"),
    flag<&C::supports_piecewise_spans>("supports_piecewise_spans", Feature::piecewise_spans),
    flag<&C::supports_paged_kv>("supports_paged_kv", Feature::paged_kv),
    flag<&C::supports_prefix_kv_slicing>("supports_prefix_kv_slicing", Feature::prefix_kv_slicing),
    flag<&C::supports_packed_mask_free>("supports_packed_mask_free", Feature::packed_mask_free),
    flag<&C::supports_multi_doc_packed_varlen>("supports_multi_doc_packed_varlen",
                                               Feature::multi_doc_packed_varlen),
    {"supports_attention_mask", CapabilityKind::probe, Feature::attention_mask, nullptr,
     &read_attention_mask, std::nullopt},
    flag<&C::indexes_kv_by_block_stride>("indexes_kv_by_block_stride"),
    flag<&C::supports_causal>("supports_causal", Feature::causal),
    flag<&C::supports_dense_attention_mask>("supports_dense_attention_mask",
                                            Feature::dense_attention_mask, Feature::attention_mask),
    flag<&C::exact>("exact"),
    list<&C::supported_platforms>("supported_platforms"),
    list<&C::supported_head_sizes>("supported_head_sizes"),
    list<&C::supported_dtypes>("supported_dtypes"),
    // Queried as supports_kv_cache_dtype(dtype, platform); read() gives the declared map.
    {"kv_cache_dtypes", CapabilityKind::probe, std::nullopt, nullptr,
     &read_member<&C::kv_cache_dtypes>, std::nullopt},
}};

}  // namespace

std::span<const Capability> capability_table() {
  return kTable;
}

const Capability* find_capability(std::string_view name) {
  for (const Capability& c : kTable)
    if (c.name == name) return &c;
  return nullptr;
}

const Capability* capability_for(Feature f) {
  for (const Capability& c : kTable)
    if (c.feature == f) return &c;
  return nullptr;
}

}  // namespace dattn
