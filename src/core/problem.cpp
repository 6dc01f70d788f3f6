#include "dattn/problem.hpp"

#include <sstream>

#include "dattn/capabilities.hpp"

namespace dattn {

std::string_view feature_name(Feature f) {
  if (const Capability* c = capability_for(f)) return c->name;
  return f == Feature::lse_output ? "lse_output" : "?";
}

std::vector<Feature> FeatureSet::list() const {
  std::vector<Feature> out;
  for (std::uint32_t bit = 1; bit != 0 && bit <= static_cast<std::uint32_t>(kLastFeature);
       bit <<= 1)
    if (bits_ & bit) out.push_back(static_cast<Feature>(bit));
  return out;
}

std::string FeatureSet::to_string() const {
  std::string s;
  for (Feature f : list()) s += (s.empty() ? "" : ", ") + std::string(feature_name(f));
  return s.empty() ? "none" : s;
}

std::string AttentionProblem::describe() const {
  std::ostringstream os;
  os << "B=" << batch << " Sq=" << sq << " Skv=" << skv << " Hq=" << hq << " Hkv=" << hkv
     << " D=" << d << " Dv=" << dv << " q=" << dtype_name(q.dtype())
     << " kv=" << dtype_name(k.dtype()) << " out=" << dtype_name(out.dtype()) << " rule="
     << (position_rule == PositionRule::full     ? "full"
         : position_rule == PositionRule::causal ? "causal"
                                                 : "piecewise")
     << " segments=" << segments.size() << " features=" << features.to_string();
  return os.str();
}

}  // namespace dattn
