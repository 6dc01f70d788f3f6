// AMX's eight tile registers and the tile instructions amx_impl.hpp uses, emulated in portable
// C++: thread-local 16 x 64-byte registers, TDPBF16PS in the instruction's order (Intel SDM:
// for each row m, pair k and column n, C[m][n] += A[m].even * B[k].even, then += A[m].odd *
// B[k].odd, f32 FMAs with bf16 denormal inputs read as zero). Include inside an engine's
// namespace, after <cstring> and "dattn/dtype.hpp".

struct EmulatedTiles {
  struct Reg {
    alignas(64) unsigned char bytes[16][64];
  };
  static Reg* regs() {
    thread_local Reg r[8];
    return r;
  }
  static void begin() {}
  static void end() {}
  static void ensure() {}
  template <int t>
  static void zero() {
    std::memset(regs()[t].bytes, 0, sizeof(Reg::bytes));
  }
  template <int t>
  static void load(const void* p, long stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(regs()[t].bytes[r], static_cast<const unsigned char*>(p) + r * stride, 64);
  }
  template <int t>
  static void store(void* p, long stride) {
    for (int r = 0; r < 16; ++r)
      std::memcpy(static_cast<unsigned char*>(p) + r * stride, regs()[t].bytes[r], 64);
  }
  // A bf16 input with a zero exponent (zero or denormal) reads as a signed zero.
  static float daz(std::uint16_t bits) {
    if ((bits & 0x7f80u) == 0) bits &= 0x8000u;
    return bf16_to_f32(bits);
  }
  static float bf16_at(const Reg& t, int row, int element) {
    std::uint16_t bits = 0;
    std::memcpy(&bits, t.bytes[row] + 2 * element, 2);
    return daz(bits);
  }
  template <int c, int a, int b>
  static void dp() {
    Reg* reg = regs();
    float acc[16][16];
    std::memcpy(acc, reg[c].bytes, sizeof(acc));
    for (int m = 0; m < 16; ++m)
      for (int k = 0; k < 16; ++k) {
        const float a_even = bf16_at(reg[a], m, 2 * k), a_odd = bf16_at(reg[a], m, 2 * k + 1);
        for (int n = 0; n < 16; ++n) {
          float x = std::fma(a_even, bf16_at(reg[b], k, 2 * n), acc[m][n]);
          acc[m][n] = std::fma(a_odd, bf16_at(reg[b], k, 2 * n + 1), x);
        }
      }
    std::memcpy(reg[c].bytes, acc, sizeof(acc));
  }
  // TDPBSSD (amx_int8): for each row m, group k and column n, C[m][n] += the four products of
  // A[m]'s signed bytes 4k..4k+3 and B[k]'s 4n..4n+3, in 32-bit wrapping integers.
  template <int c, int a, int b>
  static void dp_int8() {
    Reg* reg = regs();
    std::uint32_t acc[16][16];
    std::memcpy(acc, reg[c].bytes, sizeof(acc));
    for (int m = 0; m < 16; ++m)
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 16; ++n) {
          std::int32_t sum = 0;
          for (int t = 0; t < 4; ++t)
            sum += std::int32_t(static_cast<std::int8_t>(reg[a].bytes[m][4 * k + t])) *
                   std::int32_t(static_cast<std::int8_t>(reg[b].bytes[k][4 * n + t]));
          acc[m][n] += static_cast<std::uint32_t>(sum);  // |sum| <= 4 * 128 * 128: no overflow
        }
    std::memcpy(reg[c].bytes, acc, sizeof(acc));
  }
};
