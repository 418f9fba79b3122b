// SPDX-License-Identifier: Apache-2.0
// The int4 kernel's path for many rows of bfloat16 x on AVX-512 BF16 (dense_int4.cc, "avx512_bf16"):
// each packed panel is dequantized once to q s + m in bfloat16 pairs (the layout of
// `Bf16VectorBlock`, dense_avx512_bf16.h), then every row runs on the bfloat16 kernel's register
// blocks: the product of the weights as a bfloat16 checkpoint would hold them, at its speed.
// Keeping the values exact instead (u in bfloat16, each group's sums scaled apart) costs a fold per
// group that leaves room for half the accumulators, and a third of the speed; at many rows the
// weights' own 4-bit rounding dwarfs bfloat16's. Widening in registers for every row block would
// cost more than the products: the panel is written once and reread from L2.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

#include "dense_avx512_bf16.h"

namespace vllm_xla {

constexpr int64_t kInt4PanelCols = 16;

// The k-th (0 to 7) unsigned value of each 32-bit word as float32 (its bit position as the
// packing puts it: byte k % 4, high nibble from k 4). VPERMPS reads only an index's low four bits,
// so looking the nibble up in a table of 0 to 15 masks and converts it in one instruction.
template <int k>
VLLM_XLA_AVX512BF16 inline __m512 Int4ValueAt(__m512i words) {
  constexpr int bit = (k % 4) * 8 + (k / 4) * 4;
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(bit == 0 ? words : _mm512_srli_epi32(words, bit), values);
}

// Values k and k + 1 of each word dequantized (u s + base) and rounded to bfloat16 (to nearest
// even), as one pair a 32-bit lane: k in the low half, k + 1 in the high one. VCVTNE2PS2BF16
// rounds both vectors at once (k's 16 values, then k + 1's) and VPERMW interleaves them.
template <int k>
VLLM_XLA_AVX512BF16 inline __m512i Int4PairAt(__m512i words, __m512 s, __m512 base) {
  const __m512 even = _mm512_fmadd_ps(Int4ValueAt<k>(words), s, base);
  const __m512 odd = _mm512_fmadd_ps(Int4ValueAt<k + 1>(words), s, base);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// 16 scales (or offsets) of a panel from float32, or from float16 bits widened exactly (GGUF
// Q4_1's own d and minimum, read as they are: widening all of a weight's to float32 first would
// be a serial pass over them before the threads start, a few percent of a 64-row call).
VLLM_XLA_AVX512BF16 inline __m512 LoadPanelScales(const float* at) { return _mm512_loadu_ps(at); }
VLLM_XLA_AVX512BF16 inline __m512 LoadPanelScales(const uint16_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// One packed panel [K/8, 16] (uint32 words of eight k) -> its dequantized values q s + m in
// bfloat16 pairs [K/2, 16, 2]. `scale` and `offset` (null: none; float32, or float16 bits) point
// at the panel's first column of group 0, `stride` values from one group to the next; `group` k
// share them. Each group's base (the weight of u = 0) is offset + scale_in_base * s: -8 for
// offsets m, 0 for bases.
template <typename Scale>
VLLM_XLA_AVX512BF16 void WidenInt4PanelToPairs(const uint32_t* panel, int64_t K, int64_t group, const Scale* scale,
                                               const Scale* offset, float scale_in_base, int64_t stride,
                                               uint16_t* to) {
  const int64_t group_words = group / 8;
  for (int64_t g = 0; g < K / group; ++g) {
    const __m512 s = LoadPanelScales(scale + g * stride);
    const __m512 m = offset != nullptr ? LoadPanelScales(offset + g * stride) : _mm512_setzero_ps();
    const __m512 base = _mm512_fmadd_ps(s, _mm512_set1_ps(scale_in_base), m);  // u s + m - 8 s = q s + m
    for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
      const __m512i words = _mm512_loadu_si512(panel + word * kInt4PanelCols);
      uint16_t* out = to + word * 8 * kInt4PanelCols;
      _mm512_storeu_si512(out, Int4PairAt<0>(words, s, base));
      _mm512_storeu_si512(out + 32, Int4PairAt<2>(words, s, base));
      _mm512_storeu_si512(out + 64, Int4PairAt<4>(words, s, base));
      _mm512_storeu_si512(out + 96, Int4PairAt<6>(words, s, base));
    }
  }
}

}  // namespace vllm_xla

#endif  // __x86_64__
