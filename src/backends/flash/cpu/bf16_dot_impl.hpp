// The bf16-dot FLASH kernels (Q.K^T and P.V on bf16 pairs, f32 accumulation) written once over
// a dot type `D`, instantiated by kernels_avx512_bf16.cpp (vdpbf16ps, inside its target region)
// and kernels_bf16_emulated.cpp (portable C++). Include only from there, after the standard
// headers and inside a per-engine namespace.
//
// D provides: reg (W = 16 f32 lanes), zero(), set1(f), load(p), store(p, r), mul(a, b),
// not_finite_to_nan(r) (x * 0 + x), and dot(acc, pairs, b): for every lane i,
// acc[i] += a_odd * b_odd, then += a_even * b_even, as VDPBF16PS does (each step an f32 FMA,
// bf16 denormal inputs read as zero, denormal results flushed to zero), where `pairs` points at
// 16 consecutive pairs and b is one pair broadcast to every lane.
//
// A pair is one uint32: the even element (index 2i) in the low 16 bits, the odd one (2i + 1) in
// the high 16 bits; a missing odd element (odd d, odd key counts) is zero. Workspace layout
// (each array 64-byte aligned, after a header):
//   q  [d2][rows_p]   pairs of QT over d, packed once per work item (d2 = ceil(d / 2))
//   k  [keys][d2]     pairs of a K tile over d
//   p  [rows_p][k2]   probabilities rounded to bf16, pairs over keys (k2 = ceil(keys / 2))
//   v  [k2][dv]       pairs of a V tile over keys (rows 2j and 2j + 1 interleaved)

struct Workspace {
  std::uint32_t *q, *k, *p, *v;
  int rows_p, d2, dv, max_keys;
};

constexpr std::size_t kAlign = 64;
constexpr std::size_t align_up(std::size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

struct Sizes {
  std::size_t head, q, k, p, v;
  std::size_t total() const { return head + q + k + p + v; }
};
inline Sizes sizes(int rows_p, int d, int dv, int max_keys) {
  const std::size_t d2 = std::size_t(d + 1) / 2, k2 = std::size_t(max_keys + 1) / 2;
  const std::size_t u = sizeof(std::uint32_t);
  return {align_up(sizeof(Workspace)), align_up(d2 * std::size_t(rows_p) * u),
          align_up(std::size_t(max_keys) * d2 * u), align_up(std::size_t(rows_p) * k2 * u),
          align_up(k2 * std::size_t(dv) * u)};
}

inline std::size_t workspace_bytes(int rows_p, int d, int dv, int max_keys) {
  return sizes(rows_p, d, dv, max_keys).total();
}

inline std::uint32_t pair(float even, float odd) {
  return std::uint32_t(f32_to_bf16(even)) | (std::uint32_t(f32_to_bf16(odd)) << 16);
}

inline void pack_q(const float* qt, std::int64_t ldqt, int rows_p, int d, int dv, int max_keys,
                   void* ws) {
  const Sizes s = sizes(rows_p, d, dv, max_keys);
  auto* base = static_cast<unsigned char*>(ws);
  auto* w = static_cast<Workspace*>(ws);
  w->q = reinterpret_cast<std::uint32_t*>(base + s.head);
  w->k = reinterpret_cast<std::uint32_t*>(base + s.head + s.q);
  w->p = reinterpret_cast<std::uint32_t*>(base + s.head + s.q + s.k);
  w->v = reinterpret_cast<std::uint32_t*>(base + s.head + s.q + s.k + s.p);
  w->rows_p = rows_p;
  w->d2 = (d + 1) / 2;
  w->dv = dv;
  w->max_keys = max_keys;
  for (int e2 = 0; e2 < w->d2; ++e2) {
    const float* even = qt + 2 * e2 * ldqt;
    const float* odd = 2 * e2 + 1 < d ? even + ldqt : nullptr;
    std::uint32_t* dst = w->q + std::int64_t(e2) * rows_p;
    for (int r = 0; r < rows_p; ++r) dst[r] = pair(even[r], odd ? odd[r] : 0.0f);
  }
}

// ST[j][r0..r0+2W) for MK keys: k points at the keys' pairs, q at QT's pairs of column r0.
template <class D, int MK>
inline void qk_keys(const std::uint32_t* k, int d2, const std::uint32_t* q, int rows_p, float* st,
                    std::int64_t ldst) {
  using R = typename D::reg;
  R acc[MK][2];
  for (int m = 0; m < MK; ++m) acc[m][0] = acc[m][1] = D::zero();
  for (int e2 = 0; e2 < d2; ++e2) {
    const std::uint32_t* qe = q + std::int64_t(e2) * rows_p;
#pragma GCC unroll 8
    for (int m = 0; m < MK; ++m) {
      const std::uint32_t kb = k[m * d2 + e2];
      acc[m][0] = D::dot(acc[m][0], qe, kb);
      acc[m][1] = D::dot(acc[m][1], qe + D::W, kb);
    }
  }
  for (int m = 0; m < MK; ++m) {
    D::store(st + m * ldst, D::not_finite_to_nan(acc[m][0]));
    D::store(st + m * ldst + D::W, D::not_finite_to_nan(acc[m][1]));
  }
}

template <class D>
void qk(const float* k, std::int64_t ldk, const float* /*qt*/, std::int64_t /*ldqt*/, float* st,
        std::int64_t ldst, int keys, int rows_p, int d, void* ws) {
  const Workspace& w = *static_cast<const Workspace*>(ws);
  const int d2 = w.d2;
  for (int j = 0; j < keys; ++j) {
    const float* row = k + j * ldk;
    std::uint32_t* dst = w.k + std::int64_t(j) * d2;
    for (int e2 = 0; e2 < d2; ++e2)
      dst[e2] = pair(row[2 * e2], 2 * e2 + 1 < d ? row[2 * e2 + 1] : 0.0f);
  }
  for (int r0 = 0; r0 < rows_p; r0 += 2 * D::W) {
    const std::uint32_t* q = w.q + r0;
    int j = 0;
    for (; j + 4 <= keys; j += 4)
      qk_keys<D, 4>(w.k + j * d2, d2, q, rows_p, st + j * ldst + r0, ldst);
    const std::uint32_t* kj = w.k + j * d2;
    float* sj = st + j * ldst + r0;
    switch (keys - j) {
      case 3:
        qk_keys<D, 3>(kj, d2, q, rows_p, sj, ldst);
        break;
      case 2:
        qk_keys<D, 2>(kj, d2, q, rows_p, sj, ldst);
        break;
      case 1:
        qk_keys<D, 1>(kj, d2, q, rows_p, sj, ldst);
        break;
      default:
        break;
    }
  }
}

// O[r][c..c+2W) for MR rows: p points at row r's probability pairs, v at column c's pairs.
template <class D, int MR>
inline void pv_rows(const std::uint32_t* p, int k2, const std::uint32_t* v, int dv, float* o,
                    std::int64_t ldo, const float* alpha) {
  using R = typename D::reg;
  R acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    const R a = D::set1(alpha[r]);
    acc[r][0] = D::mul(D::load(o + r * ldo), a);
    acc[r][1] = D::mul(D::load(o + r * ldo + D::W), a);
  }
  for (int j2 = 0; j2 < k2; ++j2) {
    const std::uint32_t* vj = v + std::int64_t(j2) * dv;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const std::uint32_t pb = p[r * k2 + j2];
      acc[r][0] = D::dot(acc[r][0], vj, pb);
      acc[r][1] = D::dot(acc[r][1], vj + D::W, pb);
    }
  }
  for (int r = 0; r < MR; ++r) {
    D::store(o + r * ldo, acc[r][0]);
    D::store(o + r * ldo + D::W, acc[r][1]);
  }
}

template <class D>
void pv(const float* pt, std::int64_t ldpt, const float* v, std::int64_t ldv, float* o,
        std::int64_t ldo, const float* alpha, int rows, int keys, int dv, void* ws) {
  const Workspace& w = *static_cast<const Workspace*>(ws);
  const int k2 = (keys + 1) / 2;
  for (int r = 0; r < rows; ++r) {
    std::uint32_t* dst = w.p + std::int64_t(r) * k2;
    for (int j2 = 0; j2 < k2; ++j2)
      dst[j2] = pair(pt[2 * j2 * ldpt + r], 2 * j2 + 1 < keys ? pt[(2 * j2 + 1) * ldpt + r] : 0.0f);
  }
  for (int j2 = 0; j2 < k2; ++j2) {
    const float* even = v + 2 * j2 * ldv;
    const float* odd = 2 * j2 + 1 < keys ? even + ldv : nullptr;
    std::uint32_t* dst = w.v + std::int64_t(j2) * dv;
    for (int c = 0; c < dv; ++c) dst[c] = pair(even[c], odd ? odd[c] : 0.0f);
  }
  for (int c = 0; c < dv; c += 2 * D::W) {
    int r = 0;
    for (; r + 4 <= rows; r += 4)
      pv_rows<D, 4>(w.p + r * k2, k2, w.v + c, dv, o + r * ldo + c, ldo, alpha + r);
    const std::uint32_t* pr = w.p + r * k2;
    float* orow = o + r * ldo + c;
    switch (rows - r) {
      case 3:
        pv_rows<D, 3>(pr, k2, w.v + c, dv, orow, ldo, alpha + r);
        break;
      case 2:
        pv_rows<D, 2>(pr, k2, w.v + c, dv, orow, ldo, alpha + r);
        break;
      case 1:
        pv_rows<D, 1>(pr, k2, w.v + c, dv, orow, ldo, alpha + r);
        break;
      default:
        break;
    }
  }
}

// The functions an engine's TileKernels take from here (instantiated inside the including
// file's target region; bf16_tile_kernels() assembles them outside it).
template <class D>
constexpr Bf16DotFunctions bf16_dot_functions() {
  return {&qk<D>, &pv<D>, &workspace_bytes, &pack_q, 2 * D::W};
}
