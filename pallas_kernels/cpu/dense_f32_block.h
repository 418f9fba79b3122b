// SPDX-License-Identifier: Apache-2.0
// The float32 register blocks the dense paths run: x rows in float32 against one 16-column panel
// of float32 weights laid out [K, 16] (the float32 kernel's packed panels, or a bfloat16 or int4
// panel widened once for many rows), on AVX2 (`F32Block`) or AVX-512 (`F32Block512`).
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

namespace vllm_xla {

constexpr int kF32BlockRows = 6;  // rows of x in a register block (two 8-column halves each)
constexpr int64_t kF32BlockCols = 16;

// y[0 : R, 0 : 16] (row stride `y_stride`) = x[0 : R, 0 : K] (row stride K) @ panel[K, 16],
// accumulated over all of K in registers. With one or two rows, even and odd k accumulate apart, so
// enough FMA chains run at once. x is read with `_mm256_set1_ps(x[i])`: a broadcast from a pointer
// may alias the accumulators for GCC, which then stores them every step.
template <int R>
__attribute__((target("avx2,fma"))) void F32Block(const float* __restrict x, const float* __restrict w,
                                                   int64_t K, float* y, int64_t y_stride) {
  constexpr int kChains = R <= 2 ? 2 : 1;
  __m256 acc[R][2][kChains];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm256_setzero_ps();
  const int64_t steps = K / kChains * kChains;
  for (int64_t k = 0; k < steps; k += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const float* line = w + (k + c) * kF32BlockCols;
      const __m256 low = _mm256_loadu_ps(line), high = _mm256_loadu_ps(line + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(x[r * K + k + c]);
        acc[r][0][c] = _mm256_fmadd_ps(low, xs, acc[r][0][c]);
        acc[r][1][c] = _mm256_fmadd_ps(high, xs, acc[r][1][c]);
      }
    }
  }
  if constexpr (kChains == 2) {
    if (steps < K) {  // an odd K's last row
      const float* line = w + steps * kF32BlockCols;
      const __m256 low = _mm256_loadu_ps(line), high = _mm256_loadu_ps(line + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(x[r * K + steps]);
        acc[r][0][0] = _mm256_fmadd_ps(low, xs, acc[r][0][0]);
        acc[r][1][0] = _mm256_fmadd_ps(high, xs, acc[r][1][0]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m256 sum = acc[r][h][0];
      if constexpr (kChains == 2) sum = _mm256_add_ps(sum, acc[r][h][1]);
      _mm256_storeu_ps(y + r * y_stride + h * 8, sum);
    }
  }
}

using F32BlockKernel = void (*)(const float*, const float*, int64_t, float*, int64_t);

// The register block for `rows` (1 to kF32BlockRows) rows.
inline F32BlockKernel F32BlockFor(int rows) {
  static constexpr F32BlockKernel kKernels[kF32BlockRows] = {&F32Block<1>, &F32Block<2>, &F32Block<3>,
                                                             &F32Block<4>, &F32Block<5>, &F32Block<6>};
  return kKernels[rows - 1];
}

constexpr int kF32Block512Rows = 12;  // rows of x in an AVX-512 register block (one register each)

// `F32Block` with a whole 16-column line in one AVX-512 register and up to `kF32Block512Rows`
// rows a block: each line loaded serves twice the rows, and each FMA computes twice the columns.
// Its loops over rows unroll whole: an accumulator array indexed in a loop would live in memory.
// Each output accumulates its k in order, in two chains in a block of one or two rows (as
// `F32Block`'s): a row's bits depend on the size of the block it falls in, as there.
template <int R>
__attribute__((target("avx2,fma,avx512f"))) void F32Block512(const float* __restrict x, const float* __restrict w,
                                                             int64_t K, float* y, int64_t y_stride) {
  constexpr int kChains = R <= 2 ? 2 : 1;
  __m512 acc[R][kChains];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t steps = K / kChains * kChains;
  for (int64_t k = 0; k < steps; k += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const __m512 line = _mm512_loadu_ps(w + (k + c) * kF32BlockCols);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm512_fmadd_ps(line, _mm512_set1_ps(x[r * K + k + c]), acc[r][c]);
      }
    }
  }
  if constexpr (kChains == 2) {
    if (steps < K) {  // an odd K's last row
      const __m512 line = _mm512_loadu_ps(w + steps * kF32BlockCols);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm512_fmadd_ps(line, _mm512_set1_ps(x[r * K + steps]), acc[r][0]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
    if constexpr (kChains == 2) sum = _mm512_add_ps(sum, acc[r][1]);
    _mm512_storeu_ps(y + r * y_stride, sum);
  }
}

// `F32Block512` over two panels at once (`w`, then `w2`: y's 32 columns from `y`): each x value
// broadcast serves two FMAs, so the loads keep pace with the FMA units.
template <int R>
__attribute__((target("avx2,fma,avx512f"))) void F32Block512Pair(const float* __restrict x, const float* __restrict w,
                                                                 const float* __restrict w2, int64_t K, float* y,
                                                                 int64_t y_stride) {
  constexpr int kChains = R <= 2 ? 2 : 1;
  __m512 acc[R][2][kChains];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm512_setzero_ps();
  }
  const int64_t steps = K / kChains * kChains;
  for (int64_t k = 0; k < steps; k += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const __m512 line = _mm512_loadu_ps(w + (k + c) * kF32BlockCols);
      const __m512 line2 = _mm512_loadu_ps(w2 + (k + c) * kF32BlockCols);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(x[r * K + k + c]);
        acc[r][0][c] = _mm512_fmadd_ps(line, xs, acc[r][0][c]);
        acc[r][1][c] = _mm512_fmadd_ps(line2, xs, acc[r][1][c]);
      }
    }
  }
  if constexpr (kChains == 2) {
    if (steps < K) {  // an odd K's last row
      const __m512 line = _mm512_loadu_ps(w + steps * kF32BlockCols);
      const __m512 line2 = _mm512_loadu_ps(w2 + steps * kF32BlockCols);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(x[r * K + steps]);
        acc[r][0][0] = _mm512_fmadd_ps(line, xs, acc[r][0][0]);
        acc[r][1][0] = _mm512_fmadd_ps(line2, xs, acc[r][1][0]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m512 sum = acc[r][h][0];
      if constexpr (kChains == 2) sum = _mm512_add_ps(sum, acc[r][h][1]);
      _mm512_storeu_ps(y + r * y_stride + h * kF32BlockCols, sum);
    }
  }
}

using F32PairKernel = void (*)(const float*, const float*, const float*, int64_t, float*, int64_t);

// The two-panel AVX-512 register block for `rows` (1 to kF32Block512Rows) rows.
inline F32PairKernel F32Block512PairFor(int rows) {
  static constexpr F32PairKernel kKernels[kF32Block512Rows] = {
      &F32Block512Pair<1>, &F32Block512Pair<2>, &F32Block512Pair<3>,  &F32Block512Pair<4>,
      &F32Block512Pair<5>, &F32Block512Pair<6>, &F32Block512Pair<7>,  &F32Block512Pair<8>,
      &F32Block512Pair<9>, &F32Block512Pair<10>, &F32Block512Pair<11>, &F32Block512Pair<12>};
  return kKernels[rows - 1];
}

// The AVX-512 register block for `rows` (1 to kF32Block512Rows) rows.
inline F32BlockKernel F32Block512For(int rows) {
  static constexpr F32BlockKernel kKernels[kF32Block512Rows] = {
      &F32Block512<1>, &F32Block512<2>, &F32Block512<3>, &F32Block512<4>,  &F32Block512<5>,  &F32Block512<6>,
      &F32Block512<7>, &F32Block512<8>, &F32Block512<9>, &F32Block512<10>, &F32Block512<11>, &F32Block512<12>};
  return kKernels[rows - 1];
}

}  // namespace vllm_xla

#endif  // __x86_64__
