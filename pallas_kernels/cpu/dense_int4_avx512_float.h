// SPDX-License-Identifier: Apache-2.0
// The int4 dense kernel's (dense_int4.cc) "avx512_float" path: float32 x against the nibbles
// widened to float32 in registers, as "avx2_float" does, with a whole 16-column panel line in one
// AVX-512 register. The float product, a few rows at a time: each widened line serves every row
// of a register block (up to `kFloat512Rows`), so a row more costs one FMA a value where
// "avx2_float" (3 rows a block, half a line a register) widens the line again every 3 rows.
// Many rows take "avx2_float"'s path (each panel dequantized once to float32), on the float32
// kernel's AVX-512 blocks (`F32Block512`).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "dense_blocks.h"
#include "dense_f32_block.h"
#include "dense_int4_avx2.h"

namespace vllm_xla {
namespace int4 {

constexpr int kFloat512Rows = 8;  // rows in a register block: 8 accumulators and 8 totals

#define VLLM_XLA_INT4_AVX512F __attribute__((target("avx2,fma,avx512f")))
// Register blocks unroll whole: an accumulator array indexed in a loop would live in memory, and
// a nibble's shift needs its count as an immediate.
#define VLLM_XLA_UNROLL_INT4_512 _Pragma("GCC unroll 16")

struct Avx512FloatInt4 : Avx2Int4 {
  void Run(const Item& item) const {
    if (M > kWidenAheadAbove) return RunWidened512(item);
    WalkRegisterBlocks(item, M, K * sizeof(float), kFloat512Rows, 1, [&](int64_t row, int rows, int64_t block, int) {
      kBlocks[rows - 1](*this, row, block);
    });
  }

  // Many rows: each column panel dequantized to float32 once per chunk of rows, as "avx2_float"
  // does, then the rows on the AVX-512 float32 blocks, two panels a block.
  void RunWidened512(const Item& item) const {
    std::vector<float> panels(2 * K * kCols);
    float* const second = panels.data() + K * kCols;
    int64_t widened = -1;  // the first column block `panels` holds
    WalkRegisterBlocks(item, M, K * sizeof(float), vllm_xla::kF32Block512Rows, 2,
                       [&](int64_t row, int rows, int64_t block, int cols) {
                         if (block != widened) {
                           DequantizePanel(block, panels.data());
                           if (cols == 2) DequantizePanel(block + 1, second);
                           widened = block;
                         }
                         vllm_xla::F32Block512For(rows, cols)(x + row * K, panels.data(), second, K,
                                                              y + row * N + block * kCols, N);
                       });
  }

  // The base m - 8 s of the panel's 16 columns from their scales `s` (-8 s without offsets; the
  // bases as they are with `scale_in_base` 0), `at` into the offsets.
  VLLM_XLA_INT4_AVX512F inline __m512 Base16(__m512 s, int64_t at) const {
    const __m512 m = offset != nullptr ? _mm512_loadu_ps(offset + at) : _mm512_setzero_ps();
    return _mm512_fmadd_ps(s, _mm512_set1_ps(scale_in_base), m);
  }

  // The k-th value (0 to 7) of each 32-bit lane as float32.
  VLLM_XLA_INT4_AVX512F static inline __m512 Widen16(__m512i words, int k) {
    const __m512i shifted = _mm512_srli_epi32(words, NibbleAt(k));
    return _mm512_cvtepi32_ps(NibbleAt(k) == 28 ? shifted : _mm512_and_si512(shifted, _mm512_set1_epi32(0xF)));
  }

  // y[row : row + R, block * 16 : block * 16 + 16]: each group's products accumulate apart (in
  // `kChains` chains a row, so that enough FMAs are in flight at any R), then fold into the totals
  // times the group's scales, plus the row's sum over the group times its base.
  template <int R>
  VLLM_XLA_INT4_AVX512F static void Block(const Avx512FloatInt4& p, int64_t row, int64_t block) {
    constexpr int kChains = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
    const int64_t words = p.K / kWordDepth, group_words = p.group / kWordDepth, groups = p.Groups();
    const uint32_t* panel = p.w + block * words * kCols;
    const float* x = p.x + row * p.K;
    __m512 total[R];
    VLLM_XLA_UNROLL_INT4_512
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc[R][kChains];
      VLLM_XLA_UNROLL_INT4_512
      for (int r = 0; r < R; ++r)
        VLLM_XLA_UNROLL_INT4_512
        for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
        const __m512i line = _mm512_loadu_si512(panel + word * kCols);
        const float* xk = x + word * kWordDepth;
        VLLM_XLA_UNROLL_INT4_512
        for (int k = 0; k < kWordDepth; ++k) {
          const __m512 w = Widen16(line, k);
          VLLM_XLA_UNROLL_INT4_512
          for (int r = 0; r < R; ++r) {
            acc[r][k % kChains] = _mm512_fmadd_ps(w, _mm512_set1_ps(xk[r * p.K + k]), acc[r][k % kChains]);
          }
        }
      }
      const int64_t at = g * p.N + block * kCols;
      const __m512 s = _mm512_loadu_ps(p.scale + at), b = p.Base16(s, at);
      VLLM_XLA_UNROLL_INT4_512
      for (int r = 0; r < R; ++r) {
        __m512 sum = acc[r][0];
        VLLM_XLA_UNROLL_INT4_512
        for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
        total[r] = _mm512_fmadd_ps(sum, s, total[r]);
        total[r] = _mm512_fmadd_ps(_mm512_set1_ps(p.x_sums[(row + r) * groups + g]), b, total[r]);
      }
    }
    VLLM_XLA_UNROLL_INT4_512
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + (row + r) * p.N + block * kCols, total[r]);
  }

  using BlockKernel = void (*)(const Avx512FloatInt4&, int64_t, int64_t);
  static constexpr BlockKernel kBlocks[kFloat512Rows] = {&Block<1>, &Block<2>, &Block<3>, &Block<4>,
                                                         &Block<5>, &Block<6>, &Block<7>, &Block<8>};
};

#undef VLLM_XLA_UNROLL_INT4_512
#undef VLLM_XLA_INT4_AVX512F

}  // namespace int4
}  // namespace vllm_xla
#endif  // __x86_64__
