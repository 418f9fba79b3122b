// SPDX-License-Identifier: Apache-2.0
// The bfloat16 dense kernel's AVX2 FMA path (dense.cc), for CPUs without bfloat16 products: the
// products run in float32. A bfloat16 is the high half of a float32, and each 32-bit lane of a
// packed tile row ([N/16, K/2, 16, 2]) holds one column's pair (w[k], w[k + 1]): shifted left by 16
// the lane is w[k] as a float32, with its low half cleared it is w[k + 1].
//
// Up to 8 rows, the weights widen in registers as they stream (register blocks of up to 4 rows by
// 16 columns, x's pairs widened the same way from one broadcast load). For more rows that widening
// would repeat for every register block, so x is widened once and each column panel once per chunk
// of rows, which then run on the float32 kernel's 6x16 register blocks (faster than widening in
// registers from a few rows on, and close to the float32 kernel itself).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_blocks.h"
#include "dense_f32_block.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace vllm_xla {

#define VLLM_XLA_AVX2 __attribute__((target("avx2,fma")))

// bfloat16 values (the high halves of float32s) [count] -> float32 [count].
VLLM_XLA_AVX2 inline void WidenValues(const uint16_t* from, int64_t count, float* to) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
    _mm256_storeu_ps(to + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)));
  }
  for (; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(from[i]) << 16;
    std::memcpy(to + i, &bits, sizeof(bits));
  }
}

// A packed bfloat16 column panel [K/2, 16, 2] -> float32 [K, 16] (the float32 block's layout).
VLLM_XLA_AVX2 inline void WidenPanel(const uint16_t* panel, int64_t K, float* to) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t pair = 0; pair < K / 2; ++pair) {
    for (int h = 0; h < 2; ++h) {
      const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + pair * 32 + h * 16));
      _mm256_storeu_ps(to + 2 * pair * kF32BlockCols + h * 8, _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16)));
      _mm256_storeu_ps(to + (2 * pair + 1) * kF32BlockCols + h * 8,
                       _mm256_castsi256_ps(_mm256_and_si256(lanes, high)));
    }
  }
}

constexpr int kBf16Avx2Rows = 4;  // rows of x in an in-register-widening block
// Above this many rows x and the panels are widened ahead (`RunWidened`). At 8 rows the weights
// streaming from memory run faster widened in registers, from 16 rows widened ahead (measured on
// the embedded model's 30 layers of weights).
constexpr int64_t kWidenAheadAbove = 2 * kBf16Avx2Rows;

struct Bf16Avx2Problem {
  const uint16_t* x;    // [M, K]
  const uint16_t* w;    // [N/16, K/2, 16, 2]
  float* y;             // [M, N]
  int64_t M, K, N;
  const float* x_wide;  // x widened to float32 [M, K] when M > kWidenAheadAbove, else null

  static void Begin() {}
  static void End() {}

  void Run(const Item& item) const {
    if (x_wide != nullptr) return RunWidened(item);
    WalkRegisterBlocks(item, M, K * sizeof(uint16_t), kBf16Avx2Rows, 1,
                       [&](int64_t row, int rows, int64_t block, int) { kRowKernels[rows - 1](*this, row, block); });
  }

  // Many rows: each column panel is widened to float32 [K, 16] once per chunk of rows, which then
  // run on the float32 kernel's register blocks.
  void RunWidened(const Item& item) const {
    std::vector<float> panel(K * kF32BlockCols);
    int64_t widened = -1;  // the column block `panel` holds
    WalkRegisterBlocks(item, M, K * sizeof(float), kF32BlockRows, 1, [&](int64_t row, int rows, int64_t block, int) {
      if (block != widened) {
        WidenPanel(w + block * K * kF32BlockCols, K, panel.data());
        widened = block;
      }
      F32BlockFor(rows)(x_wide + row * K, panel.data(), K, y + row * N + block * kF32BlockCols, N);
    });
  }

  // y[row : row + R, block * 16 : block * 16 + 16], accumulated over all of K in registers, the
  // weights widened as they load. With one or two rows the even and odd k accumulate apart, so
  // enough FMA chains run at once.
  template <int R>
  VLLM_XLA_AVX2 static void Block(const Bf16Avx2Problem& p, int64_t row, int64_t block) {
    constexpr int kChains = R <= 2 ? 2 : 1;
    const int64_t pairs = p.K / 2;
    const uint16_t* w = p.w + block * pairs * 32;
    const uint16_t* x = p.x + row * p.K;
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    __m256 acc[R][2][kChains];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm256_setzero_ps();
    for (int64_t pair = 0; pair < pairs; ++pair) {
      __m256 even[2], odd[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + pair * 32 + h * 16));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(lanes, high));
      }
      for (int r = 0; r < R; ++r) {
        int32_t both;
        std::memcpy(&both, x + r * p.K + 2 * pair, sizeof(both));
        const __m256i xs = _mm256_set1_epi32(both);
        const __m256 x_even = _mm256_castsi256_ps(_mm256_slli_epi32(xs, 16));
        const __m256 x_odd = _mm256_castsi256_ps(_mm256_and_si256(xs, high));
        for (int h = 0; h < 2; ++h) {
          acc[r][h][0] = _mm256_fmadd_ps(even[h], x_even, acc[r][h][0]);
          acc[r][h][kChains - 1] = _mm256_fmadd_ps(odd[h], x_odd, acc[r][h][kChains - 1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        __m256 sum = acc[r][h][0];
        if (kChains == 2) sum = _mm256_add_ps(sum, acc[r][h][kChains - 1]);
        _mm256_storeu_ps(p.y + (row + r) * p.N + block * kF32BlockCols + h * 8, sum);
      }
    }
  }

  using BlockKernel = void (*)(const Bf16Avx2Problem&, int64_t, int64_t);
  static constexpr BlockKernel kRowKernels[kBf16Avx2Rows] = {&Block<1>, &Block<2>, &Block<3>, &Block<4>};
};

#undef VLLM_XLA_AVX2

// y[M, N] = x[M, K] @ w on AVX2 FMA, w packed [N/16, K/2, 16, 2]; K even, N a multiple of 16.
inline void RunBf16Avx2(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                        xla::ffi::ThreadPool& pool) {
  std::vector<float> x_wide;
  if (M > kWidenAheadAbove) {  // widen x once for all the row blocks
    x_wide.resize(M * K);
    WidenValues(x, M * K, x_wide.data());
  }
  RunOverColumnBlocks(Bf16Avx2Problem{x, w, y, M, K, N, x_wide.empty() ? nullptr : x_wide.data()},
                      N / kF32BlockCols, std::max<int64_t>(2, CachedBlocks(K, sizeof(uint16_t))), pool);
}

}  // namespace vllm_xla

#endif  // __x86_64__
