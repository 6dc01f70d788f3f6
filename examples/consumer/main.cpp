// Smallest use of dattn: one causal self-attention call with the automatically chosen backend.
#include <dattn/attention.hpp>

#include <cstdio>

int main() {
  const std::int64_t batch = 1, seq = 16, heads = 2, head_size = 32;
  dattn::Tensor q = dattn::Tensor::zeros({batch, seq, heads, head_size}, dattn::DType::F32);
  dattn::Tensor k = dattn::Tensor::zeros({batch, seq, heads, head_size}, dattn::DType::F32);
  dattn::Tensor v = dattn::Tensor::zeros({batch, seq, heads, head_size}, dattn::DType::F32);
  for (std::int64_t i = 0; i < v.numel(); ++i) v.data_as<float>()[i] = 1.0f;

  dattn::AttentionConfig config;
  config.num_heads = heads;
  config.head_size = head_size;
  config.causal = true;
  const dattn::Attention layer(config);
  const dattn::ForwardResult r = layer.forward(q, k, v);
  // Every row averages values that are all 1.
  std::printf("backend %s, out[0] = %.3f\n", layer.backend().name().c_str(),
              r.out.data_as<float>()[0]);
  return r.out.data_as<float>()[0] == 1.0f ? 0 : 1;
}
