// SAGE's per-row loops of the driver (item_driver.hpp, Smoothing and rotation): the queries'
// and keys' smoothing, the row terms and the rotation. They run once per query row and once per
// key, beside integer dots that AMX tiles compute at several TOPS a core, so scalar code here
// cost 13% of flux-1024 on amx_int8: each is compiled for AVX-512, AVX2 and the baseline and
// chosen by the CPU at load time (function multiversioning), with the same IEEE operations in
// each clone (this file is compiled with -ffp-contract=off: no clone fuses a multiply and an add
// that another would round twice), so the results do not depend on the clone.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backends/flash/item_driver.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DATTN_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DATTN_VECTOR_CLONES
#endif

namespace dattn::flash {
namespace {

using i64 = std::int64_t;

float sign_of(i64 e) {
  return ((std::uint64_t(e + 1) * 0x9E3779B97F4A7C15ull) >> 63) != 0 ? -1.0f : 1.0f;
}

// Rows [0, rows) of QT [d][ld], at most kChunk of them (their d x kChunk floats stay in L1
// through every pass), block by block of the rotation: with q_mean, (q - q_mean) * (1 /
// balance) first; then with `rotate` the signs (over n), the butterflies and the block's scale.
constexpr i64 kChunk = 32;

DATTN_VECTOR_CLONES
void chunk_columns(float* qt, i64 ld, i64 rows, i64 d, const float* q_mean, const float* balance,
                   bool rotate) {
  for (i64 b0 = 0; b0 < d;) {
    i64 n = 1;  // this block of d: the largest power of two left
    while (n * 2 <= d - b0) n *= 2;
    if (!rotate) n = d - b0;
    // Smoothing, then (rotate) the sign over n: 1/n is exact, and with it no partial sum of the
    // butterflies outgrows the block's largest element (halving at every stage, exactly).
    for (i64 e = b0; e < b0 + n; ++e) {
      float* col = qt + e * ld;
      if (q_mean != nullptr) {
        const float m = q_mean[e], inverse = 1.0f / balance[e];  // a multiply, not a divide
        for (i64 r = 0; r < rows; ++r) col[r] = (col[r] - m) * inverse;
      }
      if (!rotate) continue;
      const float s = sign_of(e) / float(n);
      for (i64 r = 0; r < rows; ++r) col[r] *= s;
    }
    if (rotate) {
      float* blk = qt + b0 * ld;
      const float scale = std::sqrt(float(n));
      for (i64 h = 1; h < n; h *= 2) {
        const bool last = 2 * h == n;  // the block's scale sqrt(n) with the last stage
        for (i64 i = 0; i < n; i += 2 * h)
          for (i64 j = i; j < i + h; ++j) {
            float* x = blk + j * ld;
            float* y = blk + (j + h) * ld;
            if (last) {
              for (i64 r = 0; r < rows; ++r) {
                const float u = x[r], v = y[r];
                x[r] = (u + v) * scale;
                y[r] = (u - v) * scale;
              }
            } else {
              for (i64 r = 0; r < rows; ++r) {
                const float u = x[r], v = y[r];
                x[r] = u + v;
                y[r] = u - v;
              }
            }
          }
      }
    }
    b0 += n;
  }
}

void columns_in_chunks(float* qt, i64 ld, i64 rows, i64 d, const float* q_mean,
                       const float* balance, bool rotate) {
  for (i64 r0 = 0; r0 < rows; r0 += kChunk)
    chunk_columns(qt + r0, ld, std::min(kChunk, rows - r0), d, q_mean, balance, rotate);
}

DATTN_VECTOR_CLONES
void terms_of_run(const float* qt, i64 ld, i64 rows_p, const float* mean, float qscale, i64 d,
                  float* t) {
  std::fill(t, t + rows_p, 0.0f);
  for (i64 e = 0; e < d; ++e) {
    const float m = mean[e];
    const float* col = qt + e * ld;
    for (i64 r = 0; r < rows_p; ++r) t[r] += col[r] * m;
  }
  for (i64 r = 0; r < rows_p; ++r) t[r] *= qscale;
}

// Key j's bias and its centred, balanced elements: bias = qscale * sum_e q_mean[e] (k[e] -
// mean[e]) in f64 (eight partial sums added in a fixed order); k = (k - mean) * balance.
DATTN_VECTOR_CLONES
void smooth_key_rows(const float* mean, const float* balance, const float* q_mean, float* k, i64 ld,
                     i64 n, float qscale, float* bias, i64 d) {
  for (i64 j = 0; j < n; ++j) {
    float* row = k + j * ld;
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    i64 e = 0;
    for (; e + 8 <= d; e += 8)
      for (int t = 0; t < 8; ++t) {
        const float centred = row[e + t] - mean[e + t];
        part[t] += double(q_mean[e + t]) * double(centred);
        row[e + t] = centred * balance[e + t];
      }
    for (; e < d; ++e) {
      const float centred = row[e] - mean[e];
      part[0] += double(q_mean[e]) * double(centred);
      row[e] = centred * balance[e];
    }
    const double dot =
        ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    bias[j] = float(double(qscale) * dot);
  }
}

DATTN_VECTOR_CLONES
bool all_finite(const float* x, i64 d) {
  int bad = 0;
  for (i64 e = 0; e < d; ++e) bad |= !(std::fabs(x[e]) <= std::numeric_limits<float>::max());
  return bad == 0;
}

// sum += x, squares += x * x (per element, f64); returns the sum of x * x in eight partial sums
// added in a fixed order.
DATTN_VECTOR_CLONES
double add_row(const float* x, i64 d, double* sum, double* squares) {
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  i64 e = 0;
  for (; e + 8 <= d; e += 8)
    for (int k = 0; k < 8; ++k) {
      const double v = x[e + k];
      sum[e + k] += v;
      squares[e + k] += v * v;
      part[k] += v * v;
    }
  for (; e < d; ++e) {
    const double v = x[e];
    sum[e] += v;
    squares[e] += v * v;
    part[0] += v * v;
  }
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// dst [cols][ldd] = src [rows][lds] transposed, in 8 x 8 blocks (the compiler keeps a block in
// registers).
DATTN_VECTOR_CLONES
void transpose(const float* src, i64 lds, float* dst, i64 ldd, i64 rows, i64 cols) {
  constexpr i64 kB = 8;
  for (i64 r0 = 0; r0 < rows; r0 += kB)
    for (i64 c0 = 0; c0 < cols; c0 += kB) {
      const i64 r1 = std::min(rows, r0 + kB), c1 = std::min(cols, c0 + kB);
      if (r1 - r0 == kB && c1 - c0 == kB) {
        for (i64 c = 0; c < kB; ++c)
          for (i64 r = 0; r < kB; ++r) dst[(c0 + c) * ldd + r0 + r] = src[(r0 + r) * lds + c0 + c];
      } else {
        for (i64 c = c0; c < c1; ++c)
          for (i64 r = r0; r < r1; ++r) dst[c * ldd + r] = src[r * lds + c];
      }
    }
}

}  // namespace

bool Smoothing::Sums::finite(const float* x, std::int64_t d) {
  return all_finite(x, d);
}

void Smoothing::Sums::key(const float* x, std::int64_t d, std::int64_t tile) {
  if (!all_finite(x, d)) return;
  tile_norms[std::size_t(tile)] += add_row(x, d, tile_sum.data() + tile * d, k_squares.data());
  ++tile_keys[std::size_t(tile)];
}

void Smoothing::Sums::query(const float* x, std::int64_t d) {
  if (!all_finite(x, d)) return;
  (void)add_row(x, d, q_sum.data(), q_squares.data());
  ++queries;
}

namespace rotation {

void columns(float* qt, std::int64_t ld, std::int64_t rows, std::int64_t d) {
  columns_in_chunks(qt, ld, rows, d, nullptr, nullptr, true);
}

void rows(float* k, std::int64_t ld, std::int64_t n, std::int64_t d) {
  // Through the columns' layout (the butterflies then run across keys in vectors).
  thread_local std::vector<float> t;
  t.resize(std::size_t(d * kTileKeys));
  transpose(k, ld, t.data(), kTileKeys, n, d);
  columns_in_chunks(t.data(), kTileKeys, n, d, nullptr, nullptr, true);
  transpose(t.data(), kTileKeys, k, ld, d, n);
}

}  // namespace rotation

void Smoothing::keys(float* k, std::int64_t ld, std::int64_t n, float qscale, float* bias,
                     int run) const {
  smooth_key_rows(means + run * d, balance, q_mean, k, ld, n, qscale, bias, d);
  if (rotate) rotation::rows(k, ld, n, d);
  for (int s = 0; s < swap_count; ++s)
    for (i64 j = 0; j < n; ++j) std::swap(k[j * ld + swaps[2 * s]], k[j * ld + swaps[2 * s + 1]]);
}

void Smoothing::row_terms(const float* qt, std::int64_t ld, std::int64_t rows_p, float qscale,
                          float* terms) const {
  terms_of_run(qt, ld, rows_p, means, qscale, d, terms);
  thread_local std::vector<float> diff;
  diff.resize(std::size_t(d));
  for (int n = 1; n < runs; ++n) {
    for (i64 e = 0; e < d; ++e) diff[std::size_t(e)] = means[n * d + e] - means[e];
    terms_of_run(qt, ld, rows_p, diff.data(), qscale, d, terms + n * rows_p);
  }
}

void Smoothing::queries(float* qt, std::int64_t ld, std::int64_t rows) const {
  columns_in_chunks(qt, ld, rows, d, q_mean, balance, rotate);
  for (int s = 0; s < swap_count; ++s)
    std::swap_ranges(qt + swaps[2 * s] * ld, qt + swaps[2 * s] * ld + rows,
                     qt + swaps[2 * s + 1] * ld);
}

}  // namespace dattn::flash
