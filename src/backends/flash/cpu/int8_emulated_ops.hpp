// The integer dot of the SAGE engines in portable C++, lane by lane, as the instructions compute
// it (int8_impl.hpp's `I`): G = 2 is vpmaddwd + vpaddd (two int16 products summed exactly, then
// added modulo 2^32), G = 4 with OffsetQ is vpdpbusd (four unsigned-by-signed byte products added
// modulo 2^32), G = 4 without is avx2_int8's (four signed-by-signed byte products added exactly:
// the real engine's |q| by k complemented where q < 0, pairs summed in 16 bits without
// saturating, plus each row's sum of its negative magnitudes, gives the same integers). PvGroup:
// the groups of P.V's 8-bit codes (Pv8), 2 = int16 pairs. Integers are exact, so a twin's logits
// equal its real engine's bit for bit; the conversion, the scales' product and the terms' sum are
// the same f32 operations in the same order. Include only from an engine file, inside its
// namespace, after int8_impl.hpp's headers.

template <int Lanes, int Group, bool OffsetQ, int Keys, int PvGroup = Group>
struct EmulatedInt8Ops {
  static constexpr int W = Lanes, G = Group, kKeys = Keys, kPvGroup = PvGroup;
  static constexpr bool kOffsetQ = OffsetQ;
  struct ireg {
    std::uint32_t lane[W];
  };
  static ireg zero() { return ireg{}; }
  static ireg load(const std::uint32_t* p) {
    ireg r;
    for (int i = 0; i < W; ++i) r.lane[i] = p[i];
    return r;
  }
  // The dot of one group: G / GroupOf codes, a's bytes unsigned where UnsignedA.
  template <int GroupOf, bool UnsignedA>
  static std::uint32_t group_dot(std::uint32_t a, std::uint32_t b) {
    if constexpr (GroupOf == 2) {
      const auto lo = [](std::uint32_t x) { return std::int32_t(std::int16_t(x & 0xffffu)); };
      const auto hi = [](std::uint32_t x) { return std::int32_t(std::int16_t(x >> 16)); };
      return std::uint32_t(lo(a) * lo(b) + hi(a) * hi(b));
    } else {
      std::uint32_t sum = 0;
      for (int t = 0; t < 4; ++t) {
        const std::uint32_t byte = (a >> (8 * t)) & 0xffu;
        const std::int32_t u = UnsignedA ? std::int32_t(byte) : std::int32_t(std::int8_t(byte));
        const std::int32_t s = std::int32_t(std::int8_t((b >> (8 * t)) & 0xffu));
        sum += std::uint32_t(u * s);
      }
      return sum;
    }
  }
  static ireg dot(ireg acc, const ireg& q, std::uint32_t k) {
    for (int i = 0; i < W; ++i) acc.lane[i] += group_dot<G, OffsetQ>(q.lane[i], k);
    return acc;
  }
  // P.V: the unsigned P group broadcast against the signed V groups (symmetric for pairs).
  static ireg dot_pv(ireg acc, const ireg& v, std::uint32_t p) {
    for (int i = 0; i < W; ++i) acc.lane[i] += group_dot<PvGroup, true>(p, v.lane[i]);
    return acc;
  }
  // P.V in int16 pairs (pv_dtype int16: vpmaddwd + vpaddd, vpdpwssd), whatever G the Q.K^T dot
  // takes.
  static ireg dot_pv16(ireg acc, const ireg& v, std::uint32_t p) {
    const auto lo = [](std::uint32_t x) { return std::int32_t(std::int16_t(x & 0xffffu)); };
    const auto hi = [](std::uint32_t x) { return std::int32_t(std::int16_t(x >> 16)); };
    for (int i = 0; i < W; ++i)
      acc.lane[i] += std::uint32_t(lo(p) * lo(v.lane[i]) + hi(p) * hi(v.lane[i]));
    return acc;
  }
  static void accumulate(float* o, const ireg& acc, float alpha, float ps, const float* vs) {
    for (int i = 0; i < W; ++i)
      o[i] = std::fma(static_cast<float>(static_cast<std::int32_t>(acc.lane[i])), ps * vs[i],
                      o[i] * alpha);
  }
  static void logits(float* st, const ireg& acc, std::int32_t corr, const float* qs, float ks,
                     float kb, const float* rt) {
    for (int i = 0; i < W; ++i) {
      const auto n = static_cast<std::int32_t>(acc.lane[i] - std::uint32_t(corr));
      const float x = std::fma(static_cast<float>(n), qs[i] * ks, rt != nullptr ? kb + rt[i] : kb);
      st[i] = x * 0.0f + x;  // NaN where not finite
    }
  }
};

// A twin's TileKernels (int8_tile_kernels), its softmax and row conversions those of the f32 base
// `Base` (portable_kernels for every twin but avx512_vnni's, whose real engine takes P.V on the
// bf16 dot): Q.K^T on I with P.V in f32 (emulated_int8_kernels), or P.V's codes in integers too,
// 8-bit (emulated_int8_pv8_kernels) or 16-bit (emulated_int8_pv16_kernels), on the portable base.
template <class I, const TileKernels& (*Base)() = &portable_kernels>
TileKernels emulated_int8_kernels(std::string_view name) {
  return int8_tile_kernels(name, Base(), int8_functions<I, Base>());
}
template <class I>
TileKernels emulated_int8_pv8_kernels(std::string_view name) {
  return int8_tile_kernels(name, portable_kernels(), int8pv_functions<I, &portable_kernels>());
}
template <class I>
TileKernels emulated_int8_pv16_kernels(std::string_view name) {
  return int8_tile_kernels(name, portable_kernels(),
                           int8pv_functions<I, &portable_kernels, Pv16<I>>());
}
