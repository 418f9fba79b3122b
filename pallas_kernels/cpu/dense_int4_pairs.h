// SPDX-License-Identifier: Apache-2.0
// The int4 kernel's path for many rows of bfloat16 x on AVX-512 BF16 (dense_int4.cc, "avx512_bf16"):
// each packed panel is dequantized once to q s + m in bfloat16 pairs (the layout of
// `Bf16VectorBlock`, dense_avx512_bf16.h), then every row runs on the bfloat16 kernel's register
// blocks: the product of the weights as a bfloat16 checkpoint would hold them, at its speed.
// Keeping the values exact instead (u in bfloat16, each group's sums scaled apart) costs a fold per
// group that leaves room for half the accumulators, and a third of the speed; at many rows the
// weights' own 4-bit rounding dwarfs bfloat16's. Widening in registers for every row block would
// cost more than the products: the first row block over a panel widens it as it multiplies
// (`WidenInt4Block`), writing the pairs once for the other row blocks to reread from L2.
#pragma once

#include <cstdint>
#include <cstring>

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

// Values k and k + 1 of each word dequantized (u s + base) and rounded to bfloat16 pairs
// (`RoundToPairs`: k in the low half of each 32-bit lane, k + 1 in the high one).
template <int k>
VLLM_XLA_AVX512BF16 inline __m512i Int4PairAt(__m512i words, __m512 s, __m512 base) {
  return RoundToPairs(_mm512_fmadd_ps(Int4ValueAt<k>(words), s, base),
                      _mm512_fmadd_ps(Int4ValueAt<k + 1>(words), s, base));
}

// A column group's packed panels [K/8, 16] (uint32 words of eight k) and their scales: `group` k
// share a scale and an offset (float32, or float16 bits), and each group's base (the weight of
// u = 0) is offset + scale_in_base * s: -8 for offsets m, 0 for bases.
template <typename Scale>
struct Int4Panels {
  const uint32_t* packed;  // the first panel; the next K/8 * 16 words on
  const Scale* scale;      // the first panel's first column of group 0
  const Scale* offset;     // likewise, or null (none)
  float scale_in_base;
  int64_t stride;          // values from one group's scales to the next
  int64_t K, group;
};

// Pair k / 2 of one packed word of C panels widened (`Int4PairAt`), written to `to` (panels
// `panel` values apart) and multiplied at once into R rows' accumulators as `Bf16VectorBlock`
// multiplies a stored pair (`x`: the rows' pair of k, K values apart).
template <int k, int R, int C>
VLLM_XLA_AVX512BF16 __attribute__((always_inline)) inline void WidenPairAndMultiply(
    const __m512i (&words)[C], const __m512 (&s)[C], const __m512 (&base)[C], const uint16_t* x, int64_t K,
    uint16_t* to, int64_t panel, __m512 (&acc)[R][C]) {
  __m512i pairs[C];
  for (int c = 0; c < C; ++c) {
    pairs[c] = Int4PairAt<k>(words[c], s[c], base[c]);
    _mm512_storeu_si512(to + c * panel, pairs[c]);
  }
  for (int r = 0; r < R; ++r) {
    int32_t both;
    std::memcpy(&both, x + r * K, sizeof(both));
    const __m512bh xs = (__m512bh)_mm512_set1_epi32(both);
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xs, (__m512bh)pairs[c]);
  }
}

// The first register block over a column group: y[0 : R, 0 : 16 C] (row stride `y_stride`) =
// x[0 : R, 0 : K] (bfloat16, row stride K) @ C packed panels, each panel dequantized to q s + m in
// bfloat16 pairs [K/2, 16, 2] (the layout of `Bf16VectorBlock`) into `to` (C panels `panel` values
// apart) for the group's later row blocks while this one multiplies the pairs from registers. The
// out-of-order core overlaps only instructions close together: widened ahead of the rows, the
// widening ran alone; here it runs beside this block's products. The same pairs in the same order
// as `Bf16VectorBlock`: bit for bit its result.
template <int R, int C, typename Scale>
VLLM_XLA_AVX512BF16 void WidenInt4Block(const Int4Panels<Scale>& p, const uint16_t* x, uint16_t* to, int64_t panel,
                                        float* y, int64_t y_stride) {
  const int64_t words_apart = p.K / 8 * kInt4PanelCols, group_words = p.group / 8;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.K / p.group; ++g) {
    __m512 s[C], base[C];
    for (int c = 0; c < C; ++c) {
      const int64_t at = g * p.stride + c * kInt4PanelCols;
      s[c] = LoadPanelScales(p.scale + at);
      const __m512 m = p.offset != nullptr ? LoadPanelScales(p.offset + at) : _mm512_setzero_ps();
      base[c] = _mm512_fmadd_ps(s[c], _mm512_set1_ps(p.scale_in_base), m);
    }
    for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
      __m512i words[C];
      for (int c = 0; c < C; ++c) {
        words[c] = _mm512_loadu_si512(p.packed + c * words_apart + word * kInt4PanelCols);
        // The same line of the next column group's panels into L2: the walk reaches them after this
        // group's other row blocks, which interrupt the stream the hardware prefetcher follows. A
        // prefetch past the weight's end does not fault.
        _mm_prefetch(reinterpret_cast<const char*>(p.packed + (c + kBf16VectorBlocks) * words_apart +
                                                   word * kInt4PanelCols),
                     _MM_HINT_T1);
      }
      uint16_t* out = to + word * 8 * kInt4PanelCols;
      const uint16_t* xk = x + word * 8;
      WidenPairAndMultiply<0>(words, s, base, xk, p.K, out, panel, acc);
      WidenPairAndMultiply<2>(words, s, base, xk + 2, p.K, out + 32, panel, acc);
      WidenPairAndMultiply<4>(words, s, base, xk + 4, p.K, out + 64, panel, acc);
      WidenPairAndMultiply<6>(words, s, base, xk + 6, p.K, out + 96, panel, acc);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + r * y_stride + c * 16, acc[r][c]);
}

// A column group's one packed panel [K/8, 16] dequantized to q s + m in bfloat16 pairs [K/2, 16, 2]
// at `to`, nothing multiplied: the same pairs `WidenInt4Block` writes, for a product that reads
// whole panels (the AMX path, dense_int4_amx.h).
template <typename Scale>
VLLM_XLA_AVX512BF16 void WidenInt4Panel(const Int4Panels<Scale>& p, uint16_t* to) {
  const int64_t group_words = p.group / 8;
  for (int64_t g = 0; g < p.K / p.group; ++g) {
    const __m512 s = LoadPanelScales(p.scale + g * p.stride);
    const __m512 m = p.offset != nullptr ? LoadPanelScales(p.offset + g * p.stride) : _mm512_setzero_ps();
    const __m512 base = _mm512_fmadd_ps(s, _mm512_set1_ps(p.scale_in_base), m);
    for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
      const __m512i words = _mm512_loadu_si512(p.packed + word * kInt4PanelCols);
      uint16_t* out = to + word * 8 * kInt4PanelCols;
      _mm512_storeu_si512(out, Int4PairAt<0>(words, s, base));
      _mm512_storeu_si512(out + 32, Int4PairAt<2>(words, s, base));
      _mm512_storeu_si512(out + 64, Int4PairAt<4>(words, s, base));
      _mm512_storeu_si512(out + 96, Int4PairAt<6>(words, s, base));
    }
  }
}

constexpr int kInt4WidenBlocks = 2;  // column blocks a widening register block holds (registers)

template <typename Scale>
using WidenInt4BlockKernel = void (*)(const Int4Panels<Scale>&, const uint16_t*, uint16_t*, int64_t, float*, int64_t);

// `WidenInt4Block` for `rows` (1 to kBf16VectorRows) rows by `blocks` (1 to kInt4WidenBlocks).
template <typename Scale>
WidenInt4BlockKernel<Scale> WidenInt4BlockFor(int rows, int blocks) {
#define VLLM_XLA_ROW(R) {&WidenInt4Block<R, 1, Scale>, &WidenInt4Block<R, 2, Scale>}
  static constexpr WidenInt4BlockKernel<Scale> kKernels[kBf16VectorRows][kInt4WidenBlocks] = {
      VLLM_XLA_ROW(1), VLLM_XLA_ROW(2), VLLM_XLA_ROW(3), VLLM_XLA_ROW(4), VLLM_XLA_ROW(5), VLLM_XLA_ROW(6)};
#undef VLLM_XLA_ROW
  return kKernels[rows - 1][blocks - 1];
}

}  // namespace vllm_xla

#endif  // __x86_64__
