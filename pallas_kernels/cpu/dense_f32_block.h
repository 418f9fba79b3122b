// SPDX-License-Identifier: Apache-2.0
// The float32 register block both AVX2 dense paths run: x rows in float32 against one 16-column
// panel of float32 weights laid out [K, 16] (the float32 kernel's packed panels, or a bfloat16
// panel widened once for many rows).
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

}  // namespace vllm_xla

#endif  // __x86_64__
