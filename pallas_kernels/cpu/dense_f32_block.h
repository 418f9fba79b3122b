// SPDX-License-Identifier: Apache-2.0
// The float32 register blocks the dense paths run: x rows in float32 against one 16-column panel
// of float32 weights laid out [K, 16] (the float32 kernel's packed panels, or a bfloat16 or int4
// panel widened once for many rows), on AVX2 (`F32Block`) or AVX-512 (`F32Block512`, one or two panels).
#pragma once

#include <array>
#include <cstdint>
#include <utility>

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

constexpr int kF32Block512Rows = 12;  // rows of x in an AVX-512 register block

// `F32Block` on AVX-512, over P (1 or 2) panels at once (`w`, then `w2`: y's 16 P columns from
// `y`): a whole 16-column line a register and up to `kF32Block512Rows` rows a block, so each line
// loaded serves twice the rows and each FMA computes twice the columns; with two panels each x
// value broadcast serves two FMAs, so the loads keep pace with the FMA units. Its loops over rows
// unroll whole: an accumulator array indexed in a loop would live in memory. Each output
// accumulates its k in order, in two chains in a block of one or two rows (as `F32Block`'s): a
// row's bits depend on the size of the block it falls in, as there.
// Adds k's terms into chain c of every row's accumulators over every panel (inlined into
// `F32Block512`, whose accumulators then stay in registers).
template <int R, int P, int C>
__attribute__((target("avx2,fma,avx512f"), always_inline)) inline void F32Block512Add(
    const float* __restrict x, const float* const (&panels)[2], int64_t K, int64_t k, int c, __m512 (&acc)[R][P][C]) {
  __m512 lines[P];
  for (int h = 0; h < P; ++h) lines[h] = _mm512_loadu_ps(panels[h] + k * kF32BlockCols);
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    const __m512 xs = _mm512_set1_ps(x[r * K + k]);
    for (int h = 0; h < P; ++h) acc[r][h][c] = _mm512_fmadd_ps(lines[h], xs, acc[r][h][c]);
  }
}

template <int R, int P>
__attribute__((target("avx2,fma,avx512f"))) void F32Block512(const float* __restrict x, const float* __restrict w,
                                                             const float* __restrict w2, int64_t K, float* y,
                                                             int64_t y_stride) {
  constexpr int kChains = R <= 2 ? 2 : 1;
  const float* const panels[2] = {w, w2};
  __m512 acc[R][P][kChains];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    for (int h = 0; h < P; ++h)
      for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm512_setzero_ps();
  }
  const int64_t steps = K / kChains * kChains;
  for (int64_t k = 0; k < steps; k += kChains) {
    for (int c = 0; c < kChains; ++c) F32Block512Add<R, P, kChains>(x, panels, K, k + c, c, acc);
  }
  if (steps < K) F32Block512Add<R, P, kChains>(x, panels, K, steps, 0, acc);  // an odd K's last row
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    for (int h = 0; h < P; ++h) {
      __m512 sum = acc[r][h][0];
      if constexpr (kChains == 2) sum = _mm512_add_ps(sum, acc[r][h][1]);
      _mm512_storeu_ps(y + r * y_stride + h * kF32BlockCols, sum);
    }
  }
}

using F32Block512Kernel = void (*)(const float*, const float*, const float*, int64_t, float*, int64_t);

template <int P, int... Rows>
constexpr std::array<F32Block512Kernel, sizeof...(Rows)> F32Block512Kernels(std::integer_sequence<int, Rows...>) {
  return {&F32Block512<Rows + 1, P>...};
}

// The AVX-512 register block for `rows` (1 to kF32Block512Rows) rows over `panels` (1 or 2).
inline F32Block512Kernel F32Block512For(int rows, int panels) {
  static constexpr auto kOne = F32Block512Kernels<1>(std::make_integer_sequence<int, kF32Block512Rows>());
  static constexpr auto kTwo = F32Block512Kernels<2>(std::make_integer_sequence<int, kF32Block512Rows>());
  return (panels == 2 ? kTwo : kOne)[rows - 1];
}

}  // namespace vllm_xla

#endif  // __x86_64__
