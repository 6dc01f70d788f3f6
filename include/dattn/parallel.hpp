// The seam for sequence parallelism (SPEC §12). A strategy receives one validated call and a
// function that runs attention on this process; the no-op strategy calls it once.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

// The inputs of one call as the caller passed them (layout of the layer's qkv_layout).
struct AttentionInputs {
  TensorView q, k, v;
  const AttentionMetadata* metadata = nullptr;
  TensorView out;
  std::optional<TensorView> lse;
};

using LocalAttention = std::function<void(const AttentionInputs&)>;

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;
  virtual std::string name() const = 0;
  // Runs the call, exchanging shards between ranks as the strategy needs and calling `local`
  // for the attention on this process. Inputs are validated before this is called.
  virtual void forward(const AttentionInputs& inputs, const LocalAttention& local) const = 0;
};

// One process: runs the local attention as it is.
class NoParallel final : public ParallelStrategy {
 public:
  std::string name() const override { return "none"; }
  void forward(const AttentionInputs& inputs, const LocalAttention& local) const override {
    local(inputs);
  }
};

}  // namespace dattn
