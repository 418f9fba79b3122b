// SPDX-License-Identifier: Apache-2.0
// The int4 kernel's path for a few rows of bfloat16 x on AVX-512 VNNI (dense_int4.cc,
// "avx512_vnni"): x in the int8 kernel's 16-bit fixed point (`FixedPointRows`, dense_int8_vnni.h),
// the products in int32 with VPDPBUSD.
//
// A packed line (one k-word of a 16-column panel, 64 bytes) is VPDPBUSD's unsigned operand as it
// lies after an AND (low nibbles: k 0-3 of each column, one column a 32-bit lane) or a shift and
// an AND (high nibbles: k 4-7), against a broadcast word of four plane bytes: 64 products an
// instruction, summed four to an int32 lane with no intermediate int16 (the AVX2 path's VPMADDUBSW
// needs a widening every four lines and twice the instructions for the same products). The fold per
// group is then cheap enough that GGUF's 32-input groups leave a decode step bound by the weights'
// bytes rather than by its instructions.
//
// The totals count x in units of sx (256 hi + lo), as on "avx2": each run of up to
// `kInt4VnniRunWords` words of a group is folded into float32 times the group's scales, each row's
// sum of x over the group (over sx) times the group's base m - 8 s, and the totals times sx at
// the end. The one error next to the float product is x's rounding to 16 bits, as on "avx2": at
// most sx / 2 sum_k |u_k s_k| per output.
//
// Scales and offsets are float32, or float16 (`Scale` uint16_t: their bits) read as they are and
// widened in registers (VCVTPH2PS, exact): a GGUF Q4_1 block's own d and minimum, 4 bytes per 32
// weights instead of 8, so a decode step streams 0.625 bytes a weight instead of 0.75. With
// `scale_in_base` 0 the offsets are the bases themselves (the weight of u = 0: Q4_1's minimum,
// exact in float16 where m = minimum + 8 d is not); -8: offsets m.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "dense_int8_vnni.h"

namespace vllm_xla {

// Packed words (8 k each) whose products an int32 lane holds as 256 hi + lo: |u hi| <= 15 * 127,
// so 1024 k of them times 256 stay below 2^31.
constexpr int64_t kInt4VnniRunWords = 128;
constexpr int kInt4VnniMaxBlocks = 4;  // 16-column blocks of one row in a register block

// `LoadScales` (dense_int8_vnni.h) reads scales and offsets, float32 or float16 bits.

// Walks a work item of `Problem` (`VnniInt4` or `VnniInt4Q8`) in its register blocks: one row, two
// rows by up to `block_cols` (at most 2) column blocks, or the rows split as evenly as they go into
// blocks of up to 4 by one (5 rows: 3 + 2). A row costs about the same in any block of two or
// more, but a block of one waits on its panel's loads (a single stream, as a decode step's lone
// row does), so 4 + 1 ran slower than 3 + 2. x is at most `kVnniRowsAtMost` rows, which stay in
// cache while the item's panels pass over them.
template <typename Problem>
void WalkVnniInt4Blocks(const Problem& problem, const Item& item, int block_cols) {
  using BlockKernel = void (*)(const Problem&, int64_t, int64_t);
  // [rows - 1][blocks - 1]
  static constexpr BlockKernel kKernels[4][kInt4VnniMaxBlocks] = {
      {&Problem::template Block<1, 1>, &Problem::template Block<1, 2>, &Problem::template Block<1, 3>,
       &Problem::template Block<1, 4>},
      {&Problem::template Block<2, 1>, &Problem::template Block<2, 2>, nullptr, nullptr},
      {&Problem::template Block<3, 1>, nullptr, nullptr, nullptr},
      {&Problem::template Block<4, 1>, nullptr, nullptr, nullptr},
  };
  const int64_t row_blocks = (problem.M + 3) / 4;
  for (int64_t col = item.first_block; col < item.end_block; col += block_cols) {
    const int cols = static_cast<int>(std::min<int64_t>(block_cols, item.end_block - col));
    for (int64_t b = 0, row = 0; b < row_blocks; ++b) {
      const int rows = static_cast<int>(problem.M / row_blocks + (b < problem.M % row_blocks ? 1 : 0));
      kKernels[rows - 1][cols - 1](problem, row, col);
      row += rows;
    }
  }
}

template <typename Scale>  // float, or uint16_t: float16 bits
struct VnniInt4 {
  const FixedPointRows* rows;  // x's planes, one 32-bit word per 4 k
  const uint32_t* w;           // [N/16, K/8, 16]
  const Scale* scale;          // [K / group, N]
  const Scale* offset;         // [K / group, N]: m (or the bases: `scale_in_base` 0), or null (0)
  const float* x_sums;         // [M, K / group]: each row's sum over each group of k, over sx (0: sx 0)
  float* y;                    // [M, N]
  int64_t M, K, N, group;
  float scale_in_base;         // a group's base is offset + scale_in_base * s

  static void Begin() {}
  static void End() {}

  // y[row : row + R, block * 16 : (block + C) * 16].
  template <int R, int C>
  VLLM_XLA_INT8_VNNI static void Block(const VnniInt4& p, int64_t row, int64_t block) {
    const int64_t panel = p.K / 8 * 16, x_words = p.rows->words, groups = p.K / p.group;
    const int64_t group_words = p.group / 8;
    const uint32_t* w = p.w + block * panel;
    const int32_t* hi = p.rows->hi.data() + row * x_words;
    const int32_t* lo = p.rows->lo.data() + row * x_words;
    const __m512i nibbles = _mm512_set1_epi8(0x0F);
    __m512 total[R][C];
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r)
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 s[C];
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) s[c] = LoadScales(p.scale + g * p.N + (block + c) * 16);
      for (int64_t first = g * group_words; first < (g + 1) * group_words; first += kInt4VnniRunWords) {
        const int64_t end = std::min(first + kInt4VnniRunWords, (g + 1) * group_words);
        __m512i high[R][C], low[R][C];
        VLLM_XLA_UNROLL
        for (int r = 0; r < R; ++r)
          VLLM_XLA_UNROLL
          for (int c = 0; c < C; ++c) high[r][c] = low[r][c] = _mm512_setzero_si512();
        for (int64_t word = first; word < end; ++word) {
          __m512i first_four[C], last_four[C];
          VLLM_XLA_UNROLL
          for (int c = 0; c < C; ++c) {
            const __m512i bytes = _mm512_loadu_si512(w + c * panel + word * 16);
            first_four[c] = _mm512_and_si512(bytes, nibbles);
            last_four[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibbles);
          }
          VLLM_XLA_UNROLL
          for (int r = 0; r < R; ++r) {
            const int32_t* h = hi + r * x_words + 2 * word;
            const int32_t* l = lo + r * x_words + 2 * word;
            const __m512i h0 = _mm512_set1_epi32(h[0]), h1 = _mm512_set1_epi32(h[1]);
            const __m512i l0 = _mm512_set1_epi32(l[0]), l1 = _mm512_set1_epi32(l[1]);
            VLLM_XLA_UNROLL
            for (int c = 0; c < C; ++c) {
              high[r][c] = DotBytes(DotBytes(high[r][c], first_four[c], h0), last_four[c], h1);
              low[r][c] = DotBytes(DotBytes(low[r][c], first_four[c], l0), last_four[c], l1);
            }
          }
        }
        VLLM_XLA_UNROLL
        for (int r = 0; r < R; ++r)
          VLLM_XLA_UNROLL
          for (int c = 0; c < C; ++c) {
            const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(high[r][c], 8), low[r][c]));
            total[r][c] = _mm512_fmadd_ps(sums, s[c], total[r][c]);
          }
      }
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) {
        const int64_t at = g * p.N + (block + c) * 16;
        const __m512 m = p.offset != nullptr ? LoadScales(p.offset + at) : _mm512_setzero_ps();
        const __m512 base = _mm512_fmadd_ps(s[c], _mm512_set1_ps(p.scale_in_base), m);
        VLLM_XLA_UNROLL
        for (int r = 0; r < R; ++r) {
          total[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p.x_sums[(row + r) * groups + g]), base, total[r][c]);
        }
      }
    }
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(p.rows->step[row + r]);
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) {
        _mm512_storeu_ps(p.y + (row + r) * p.N + (block + c) * 16, _mm512_mul_ps(total[r][c], sx));
      }
    }
  }

  void Run(const Item& item) const { WalkVnniInt4Blocks(*this, item, M == 2 ? 2 : 1); }
};

// x in one signed byte plane per block of k (llama.cpp's Q8_1, which its Q4_1 dot products take):
// each row's block of `block` k (32, or 16 or 8 where the weights' group does not split into 32s)
// rounded to dx = max|x_block| / 127, x8 = rint(x / dx), one 32-bit word per 4 k.
struct BlockInt8Rows {
  static constexpr float kLevels = 127.0f;
  int64_t words = 0;          // per row: K / 4
  int64_t block = 32;         // k a block
  int64_t blocks = 0;         // per row: K / block
  std::vector<int32_t> q;     // [M, words]
  std::vector<float> step;    // [M, blocks]: dx (0 for a block of zeros)

  // The largest of 32, 16 and 8 that divides `group` (a multiple of 8).
  static int64_t BlockFor(int64_t group) { return group % 32 == 0 ? 32 : group % 16 == 0 ? 16 : 8; }

  // Quantizes the first M rows of bfloat16 x (row stride K); false, leaving the rest undone, if a
  // value is not finite or a block's largest magnitude is positive but below `kSmallestVnniMax`.
  VLLM_XLA_INT8_VNNI bool Quantize(const uint16_t* x, int64_t M, int64_t K, int64_t group) {
    words = K / 4, block = BlockFor(group), blocks = K / block;
    q.assign(M * words, 0), step.assign(M * blocks, 0.0f);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), exponent = _mm512_set1_epi32(0x7f800000);
    const __mmask16 lanes = block >= 16 ? 0xffff : 0xff;
    auto* bytes = reinterpret_cast<int8_t*>(q.data());
    for (int64_t b = 0; b < M * blocks; ++b) {
      const uint16_t* at = x + b * block;
      __m512i most = _mm512_setzero_si512();  // the largest magnitude's bits (they order as the values)
      for (int64_t k = 0; k < block; k += 16) {
        const __m512i bits = _mm512_and_si512(Bits(at + k, lanes), magnitude);
        if (_mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent) != 0) return false;
        most = _mm512_max_epi32(most, bits);
      }
      const int32_t most_bits = _mm512_reduce_max_epi32(most);
      float largest;
      std::memcpy(&largest, &most_bits, sizeof(largest));
      if (largest > 0.0f && largest < kSmallestVnniMax) return false;
      if (largest == 0.0f) continue;  // a zero block, dx 0
      const __m512 inverse = _mm512_set1_ps(kLevels / largest);
      for (int64_t k = 0; k < block; k += 16) {
        const __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(Bits(at + k, lanes)), inverse);
        const __m512i level = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i clamped = _mm512_min_epi32(_mm512_set1_epi32(127), _mm512_max_epi32(_mm512_set1_epi32(-127), level));
        _mm512_mask_cvtepi32_storeu_epi8(bytes + b * block + k, lanes, clamped);
      }
      step[b] = largest / kLevels;
    }
    return true;
  }

 private:
  // Up to 16 bfloat16 values from `at` as float32 bits (bfloat16 is float32's high half).
  VLLM_XLA_INT8_VNNI static __m512i Bits(const uint16_t* at, __mmask16 lanes) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, at)), 16);
  }
};

// The int4 kernel's one-plane path: the nibbles against `BlockInt8Rows`, two VPDPBUSD a packed word
// and row instead of the two planes' four. The high nibbles enter as they lie after an AND with
// 0xF0 (16 u, one instruction instead of a shift and an AND) into their own int32 sums, shifted
// back once a block. Each block's sums fold into float32 times s dx; each group's base meets x's
// exact float sums as on the two-plane path. The one error next to the float product is x's
// rounding to 8 bits a block: at most sum_b dx_b / 2 sum_{k in b} |u_k s_k| per output.
template <typename Scale>  // float, or uint16_t: float16 bits
struct VnniInt4Q8 {
  const BlockInt8Rows* rows;
  const uint32_t* w;     // [N/16, K/8, 16]
  const Scale* scale;    // [K / group, N]
  const Scale* offset;   // [K / group, N], or null (0)
  const float* x_sums;   // [M, K / group]: each row's float sum over each group of k
  float* y;              // [M, N]
  int64_t M, K, N, group;
  float scale_in_base;   // a group's base is offset + scale_in_base * s

  static void Begin() {}
  static void End() {}

  template <int R, int C>
  VLLM_XLA_INT8_VNNI static void Block(const VnniInt4Q8& p, int64_t row, int64_t block) {
    const int64_t panel = p.K / 8 * 16, x_words = p.rows->words, x_blocks = p.rows->blocks;
    const int64_t groups = p.K / p.group, block_words = p.rows->block / 8, group_blocks = p.group / p.rows->block;
    const uint32_t* w = p.w + block * panel;
    const int32_t* x = p.rows->q.data() + row * x_words;
    const float* dx = p.rows->step.data() + row * x_blocks;
    const __m512i low_mask = _mm512_set1_epi8(0x0F), high_mask = _mm512_set1_epi8(static_cast<char>(0xF0));
    __m512 total[R][C];
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r)
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
        const int64_t first = b * block_words;
        __m512i low[R][C], high[R][C];
        VLLM_XLA_UNROLL
        for (int r = 0; r < R; ++r)
          VLLM_XLA_UNROLL
          for (int c = 0; c < C; ++c) low[r][c] = high[r][c] = _mm512_setzero_si512();
        for (int64_t word = first; word < first + block_words; ++word) {
          __m512i first_four[C], last_four[C];
          VLLM_XLA_UNROLL
          for (int c = 0; c < C; ++c) {
            const __m512i bytes = _mm512_loadu_si512(w + c * panel + word * 16);
            first_four[c] = _mm512_and_si512(bytes, low_mask);
            last_four[c] = _mm512_and_si512(bytes, high_mask);  // 16 u
          }
          VLLM_XLA_UNROLL
          for (int r = 0; r < R; ++r) {
            const __m512i x0 = _mm512_set1_epi32(x[r * x_words + 2 * word]);
            const __m512i x1 = _mm512_set1_epi32(x[r * x_words + 2 * word + 1]);
            VLLM_XLA_UNROLL
            for (int c = 0; c < C; ++c) {
              low[r][c] = _mm512_dpbusd_epi32(low[r][c], first_four[c], x0);
              high[r][c] = _mm512_dpbusd_epi32(high[r][c], last_four[c], x1);
            }
          }
        }
        VLLM_XLA_UNROLL
        for (int c = 0; c < C; ++c) {
          const __m512 s = LoadScales(p.scale + g * p.N + (block + c) * 16);
          VLLM_XLA_UNROLL
          for (int r = 0; r < R; ++r) {
            const __m512i sums = _mm512_add_epi32(low[r][c], _mm512_srai_epi32(high[r][c], 4));
            const __m512 s_dx = _mm512_mul_ps(s, _mm512_set1_ps(dx[r * x_blocks + b]));
            total[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), s_dx, total[r][c]);
          }
        }
      }
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) {
        const int64_t at = g * p.N + (block + c) * 16;
        const __m512 m = p.offset != nullptr ? LoadScales(p.offset + at) : _mm512_setzero_ps();
        const __m512 base = _mm512_fmadd_ps(LoadScales(p.scale + at), _mm512_set1_ps(p.scale_in_base), m);
        VLLM_XLA_UNROLL
        for (int r = 0; r < R; ++r) {
          total[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p.x_sums[(row + r) * groups + g]), base, total[r][c]);
        }
      }
    }
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r)
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(p.y + (row + r) * p.N + (block + c) * 16, total[r][c]);
  }

  void Run(const Item& item) const { WalkVnniInt4Blocks(*this, item, 1); }
};

}  // namespace vllm_xla

#endif  // __x86_64__
