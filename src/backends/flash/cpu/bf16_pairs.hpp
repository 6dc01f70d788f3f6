// Packing f32 rows into bf16 pairs, shared by the bf16 engines (bf16_dot_impl.hpp,
// amx_impl.hpp). Include only from an engine's source, inside its namespace, after the
// standard headers and "dattn/dtype.hpp".
//
// A pair is one uint32: the even element in the low 16 bits, the odd one in the high 16 bits,
// each rounded to bf16 to nearest even (NaN stays NaN). D provides two 16-pair packers:
//   pack16_consecutive(src, dst): pairs (src[2i], src[2i + 1]) of 32 consecutive floats
//   pack16_interleaved(even, odd, dst): pairs (even[i], odd[i]); odd == nullptr reads zeros

constexpr std::size_t align64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

inline std::uint32_t pair(float even, float odd) {
  return std::uint32_t(f32_to_bf16(even)) | (std::uint32_t(f32_to_bf16(odd)) << 16);
}

// dst[0..ceil(n / 2)) = pairs of src[0..n) (a missing last odd element is zero).
template <class D>
inline void pack_row_pairs(const float* src, int n, std::uint32_t* dst) {
  int i = 0;
  for (; i + 32 <= n; i += 32) D::pack16_consecutive(src + i, dst + i / 2);
  for (; i < n; i += 2) dst[i / 2] = pair(src[i], i + 1 < n ? src[i + 1] : 0.0f);
}

// dst[0..n) = pairs (even[i], odd[i]); odd == nullptr: zeros.
template <class D>
inline void pack_interleaved(const float* even, const float* odd, int n, std::uint32_t* dst) {
  int i = 0;
  for (; i + 16 <= n; i += 16)
    D::pack16_interleaved(even + i, odd != nullptr ? odd + i : nullptr, dst + i);
  for (; i < n; ++i) dst[i] = pair(even[i], odd != nullptr ? odd[i] : 0.0f);
}

// Rows 2i and 2i + 1 of src (`rows` rows of `n` floats, stride ld) as pair row i of dst
// [pair_rows][n]: ceil(rows / 2) pair rows (a missing last odd row reads zeros), then zero rows
// up to pair_rows. Q^T over d, V over keys, P^T over keys.
template <class D>
inline void pack_row_pairs_of_rows(const float* src, std::int64_t ld, int rows, int n,
                                   int pair_rows, std::uint32_t* dst) {
  const int r2 = (rows + 1) / 2;
  for (int i = 0; i < r2; ++i) {
    const float* even = src + 2 * i * ld;
    pack_interleaved<D>(even, 2 * i + 1 < rows ? even + ld : nullptr, n, dst + std::int64_t(i) * n);
  }
  std::fill(dst + std::int64_t(r2) * n, dst + std::int64_t(pair_rows) * n, 0u);
}
