// SPDX-License-Identifier: Apache-2.0
// The int4 dense kernel's (dense_int4.cc) float and AVX2 paths: the problem's operands, x in 16-bit
// fixed point for "avx2", the register blocks of "portable", "avx2" and "avx2_float", and the
// many-rows paths that dequantize each panel ahead ("avx2": float32 panels; "avx512_bf16":
// bfloat16 pairs, dense_int4_pairs.h). The paths and their error bounds are described in
// dense_int4.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "dense_f32_block.h"
#include "dense_int4_pairs.h"
#endif

#include "dense_blocks.h"

namespace vllm_xla {
namespace int4 {

constexpr int64_t kCols = 16;  // columns of a packed panel
constexpr int64_t kWordDepth = 8;  // k in a packed word
constexpr int kFloatRows = 3;  // rows in a float register block: 2 x 2 x 3 accumulators and totals
constexpr int kFixedRows = 2;  // rows in a fixed-point register block
constexpr int64_t kInt16Words = 4;  // packed lines whose byte products an int16 lane holds
// Above this many rows each panel is dequantized once per chunk of rows, then multiplied with the
// float32 kernel's register blocks (at a few rows unpacking in registers costs less than writing
// and rereading the float32 panel).
constexpr int64_t kWidenAheadAbove = 8;
// "avx512_vnni" unpacks in registers for more rows: at 16 rows it still outran the bfloat16 panels,
// at 64 they outran it (`benchmarks/dense_int4.py`).
constexpr int64_t kVnniRowsAtMost = 16;
constexpr float kFixedLevels = 32639.0f;  // |x16| <= 32639: both byte planes fit a signed byte
constexpr float kSmallestFixedMax = 1e-30f;  // below: sx would lose precision (subnormal)

// The bit at which the k-th value (0 to 7) of a packed word starts: byte k % 4, high nibble from k 4.
constexpr int NibbleAt(int k) { return (k % 4) * 8 + (k / 4) * 4; }

// The k-th value of a packed word, unsigned (u = q + 8).
inline uint32_t Nibble(uint32_t word, int k) { return (word >> NibbleAt(k)) & 0xF; }

// x's rows in 16-bit fixed point: x ~ (256 hi + lo) * step, each plane signed bytes [M, K].
struct FixedPointRows {
  std::vector<int8_t> hi, lo;
  std::vector<float> step;  // [M]: sx
  std::vector<float> inverse;  // [M]: 1 / sx (0 for a row of zeros)

  // false, leaving the rest undone, for a value that is not finite or a row whose largest
  // magnitude is positive but below `kSmallestFixedMax` (the float path must run).
  bool Quantize(const float* x, int64_t M, int64_t K) {
    hi.resize(M * K), lo.resize(M * K), step.resize(M), inverse.resize(M);
    for (int64_t r = 0; r < M; ++r) {
      const float* row = x + r * K;
      float largest = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        if (!std::isfinite(row[k])) return false;
        largest = std::max(largest, std::fabs(row[k]));
      }
      if (largest > 0.0f && largest < kSmallestFixedMax) return false;
      step[r] = largest / kFixedLevels;
      inverse[r] = largest > 0.0f ? kFixedLevels / largest : 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float scaled = std::min(kFixedLevels, std::max(-kFixedLevels, std::nearbyint(row[k] * inverse[r])));
        const int32_t fixed = static_cast<int32_t>(scaled);
        const int8_t low = static_cast<int8_t>(static_cast<uint8_t>(fixed & 0xFF));
        lo[r * K + k] = low;
        hi[r * K + k] = static_cast<int8_t>((fixed - low) / 256);
      }
    }
    return true;
  }
};

struct Int4Problem {
  const float* x;       // [M, K]
  const uint32_t* w;    // [N/16, K/8, 16]
  const float* scale;   // [K / group, N]
  const float* offset;  // [K / group, N]: m, or null (0); or the bases themselves (`scale_in_base` 0)
  const float* x_sums;  // [M, K / group]: each row's sum over each group of k
  float* y;             // [M, N]
  int64_t M, K, N;
  int64_t group;        // k that share a scale: K, or a multiple of 8 that divides K
  const FixedPointRows* fixed;  // x in fixed point (the "avx2" path), or null
  // Each group's base, the weight of stored value 0: offset + scale_in_base * s (-8: offsets m,
  // w = (u - 8) s + m; 0: `offset` holds the bases b, w = u s + b, as GGUF's Q4_1 blocks do).
  float scale_in_base = -8.0f;

  static void Begin() {}
  static void End() {}

  int64_t Groups() const { return K / group; }

  // y[row : row + rows, block * 16 : block * 16 + 16] in plain C++.
  void PortableBlock(int64_t row, int rows, int64_t block) const {
    const int64_t words = K / kWordDepth, group_words = group / kWordDepth;
    const uint32_t* panel = w + block * words * kCols;
    for (int64_t r = row; r < row + rows; ++r) {
      const float* xr = x + r * K;
      float total[kCols] = {};
      for (int64_t g = 0; g < Groups(); ++g) {
        float acc[kCols] = {};
        for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
          const uint32_t* line = panel + word * kCols;
          for (int k = 0; k < kWordDepth; ++k) {
            const float xk = xr[word * kWordDepth + k];
            for (int c = 0; c < kCols; ++c) acc[c] += xk * static_cast<float>(Nibble(line[c], k));
          }
        }
        const float* s = scale + g * N + block * kCols;
        const float* m = offset != nullptr ? offset + g * N + block * kCols : nullptr;
        const float sum = x_sums[r * Groups() + g];
        for (int c = 0; c < kCols; ++c) {
          total[c] += acc[c] * s[c] + sum * ((m != nullptr ? m[c] : 0.0f) + scale_in_base * s[c]);
        }
      }
      std::memcpy(y + r * N + block * kCols, total, sizeof(total));
    }
  }

#if defined(__x86_64__)
#define VLLM_XLA_INT4_AVX2 __attribute__((target("avx2,fma")))
// Register blocks unroll whole: an accumulator array indexed in a loop would live in memory, and
// a nibble's shift needs its count as an immediate.
#define VLLM_XLA_UNROLL_INT4 _Pragma("GCC unroll 16")

  // The base m - 8 s of 8 columns from their scales `s` (-8 s without offsets; the bases as they
  // are with `scale_in_base` 0), `at` into the offsets.
  VLLM_XLA_INT4_AVX2 inline __m256 Base(__m256 s, int64_t at) const {
    const __m256 m = offset != nullptr ? _mm256_loadu_ps(offset + at) : _mm256_setzero_ps();
    return _mm256_fmadd_ps(s, _mm256_set1_ps(scale_in_base), m);
  }

  // The k-th value (0 to 7) of each 32-bit lane as float32.
  VLLM_XLA_INT4_AVX2 static inline __m256 Widen(__m256i words, int k) {
    const __m256i shifted = _mm256_srli_epi32(words, NibbleAt(k));
    return _mm256_cvtepi32_ps(NibbleAt(k) == 28 ? shifted : _mm256_and_si256(shifted, _mm256_set1_epi32(0xF)));
  }

  // y[row : row + R, block * 16 : block * 16 + 16] with AVX2 in float32: each group's products
  // accumulate apart (two chains per 8-column half for one row, so enough FMAs run at once), then
  // fold into the totals times the group's scales, plus the row's sum over the group times its base.
  template <int R>
  VLLM_XLA_INT4_AVX2 static void FloatBlock(const Int4Problem& p, int64_t row, int64_t block) {
    constexpr int kChains = R == 1 ? 2 : 1;
    const int64_t words = p.K / kWordDepth, group_words = p.group / kWordDepth, groups = p.Groups();
    const uint32_t* panel = p.w + block * words * kCols;
    const float* x = p.x + row * p.K;
    __m256 total[R][2];
    VLLM_XLA_UNROLL_INT4
    for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[R][2][kChains];
      VLLM_XLA_UNROLL_INT4
      for (int r = 0; r < R; ++r)
        VLLM_XLA_UNROLL_INT4
        for (int h = 0; h < 2; ++h)
          VLLM_XLA_UNROLL_INT4
          for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm256_setzero_ps();
      for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
        const uint32_t* line = panel + word * kCols;
        const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 8));
        const float* xk = x + word * kWordDepth;
        VLLM_XLA_UNROLL_INT4
        for (int k = 0; k < kWordDepth; ++k) {
          const __m256 wl = Widen(low, k), wh = Widen(high, k);
          VLLM_XLA_UNROLL_INT4
          for (int r = 0; r < R; ++r) {
            const __m256 xs = _mm256_set1_ps(xk[r * p.K + k]);
            acc[r][0][k % kChains] = _mm256_fmadd_ps(wl, xs, acc[r][0][k % kChains]);
            acc[r][1][k % kChains] = _mm256_fmadd_ps(wh, xs, acc[r][1][k % kChains]);
          }
        }
      }
      VLLM_XLA_UNROLL_INT4
      for (int h = 0; h < 2; ++h) {
        const int64_t at = g * p.N + block * kCols + h * 8;
        const __m256 s = _mm256_loadu_ps(p.scale + at), b = p.Base(s, at);
        VLLM_XLA_UNROLL_INT4
        for (int r = 0; r < R; ++r) {
          __m256 sum = acc[r][h][0];
          if constexpr (kChains == 2) sum = _mm256_add_ps(sum, acc[r][h][1]);
          total[r][h] = _mm256_fmadd_ps(sum, s, total[r][h]);
          total[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(p.x_sums[(row + r) * groups + g]), b, total[r][h]);
        }
      }
    }
    VLLM_XLA_UNROLL_INT4
    for (int r = 0; r < R; ++r)
      VLLM_XLA_UNROLL_INT4
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(p.y + (row + r) * p.N + block * kCols + h * 8, total[r][h]);
  }

  // Four bytes of a plane (k .. k + 3) in every 32-bit lane: VBROADCASTSS from memory, a load
  // alone (a broadcast from a general register takes a shuffle as well).
  VLLM_XLA_INT4_AVX2 static inline __m256i Broadcast4(const int8_t* bytes) {
    return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(bytes)));
  }

  // y[row : row + R, block * 16 : block * 16 + 16] with integer products (the "avx2" path), one
  // 8-column half at a time: per run of up to 4 lines within a group, each plane's byte products
  // sum in int16 lanes (VPMADDUBSW, then VPADDW), then widen to int32 (VPMADDWD by ones) and
  // float32, 256 hi + lo, and fold into the totals times the group's scales. Totals count x in
  // units of sx: the base's part enters as the row's sum over the group over sx.
  template <int R>
  VLLM_XLA_INT4_AVX2 static void FixedPointBlock(const Int4Problem& p, int64_t row, int64_t block) {
    const int64_t words = p.K / kWordDepth, group_words = p.group / kWordDepth, groups = p.Groups();
    const uint32_t* panel = p.w + block * words * kCols;
    const int8_t* hi = p.fixed->hi.data() + row * p.K;
    const int8_t* lo = p.fixed->lo.data() + row * p.K;
    const __m256i nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    VLLM_XLA_UNROLL_INT4
    for (int h = 0; h < 2; ++h) {
      __m256 total[R];
      VLLM_XLA_UNROLL_INT4
      for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = g * p.N + block * kCols + h * 8;
        const __m256 s = _mm256_loadu_ps(p.scale + at);
        for (int64_t first = g * group_words; first < (g + 1) * group_words; first += kInt16Words) {
          const int64_t end = std::min(first + kInt16Words, (g + 1) * group_words);
          __m256i high_sums[R], low_sums[R];
          VLLM_XLA_UNROLL_INT4
          for (int r = 0; r < R; ++r) high_sums[r] = low_sums[r] = _mm256_setzero_si256();
          for (int64_t word = first; word < end; ++word) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + word * kCols + h * 8));
            const __m256i first_four = _mm256_and_si256(bytes, nibbles);  // k 0-3 of each column
            const __m256i last_four = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibbles);  // k 4-7
            VLLM_XLA_UNROLL_INT4
            for (int r = 0; r < R; ++r) {
              const int64_t k = r * p.K + word * kWordDepth;
              const __m256i high = _mm256_add_epi16(_mm256_maddubs_epi16(first_four, Broadcast4(hi + k)),
                                                    _mm256_maddubs_epi16(last_four, Broadcast4(hi + k + 4)));
              const __m256i low = _mm256_add_epi16(_mm256_maddubs_epi16(first_four, Broadcast4(lo + k)),
                                                   _mm256_maddubs_epi16(last_four, Broadcast4(lo + k + 4)));
              high_sums[r] = _mm256_add_epi16(high_sums[r], high);
              low_sums[r] = _mm256_add_epi16(low_sums[r], low);
            }
          }
          VLLM_XLA_UNROLL_INT4
          for (int r = 0; r < R; ++r) {
            const __m256 high = _mm256_cvtepi32_ps(_mm256_madd_epi16(high_sums[r], ones));
            const __m256 low = _mm256_cvtepi32_ps(_mm256_madd_epi16(low_sums[r], ones));
            total[r] = _mm256_fmadd_ps(_mm256_fmadd_ps(high, _mm256_set1_ps(256.0f), low), s, total[r]);
          }
        }
        const __m256 b = p.Base(s, at);
        VLLM_XLA_UNROLL_INT4
        for (int r = 0; r < R; ++r) {
          const float sum = p.x_sums[(row + r) * groups + g] * p.fixed->inverse[row + r];
          total[r] = _mm256_fmadd_ps(_mm256_set1_ps(sum), b, total[r]);
        }
      }
      VLLM_XLA_UNROLL_INT4
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(p.y + (row + r) * p.N + block * kCols + h * 8,
                         _mm256_mul_ps(total[r], _mm256_set1_ps(p.fixed->step[row + r])));
      }
    }
  }

  // One packed panel -> its float32 weights [K, 16], u s + m - 8 s (the float32 block's layout).
  VLLM_XLA_INT4_AVX2 void DequantizePanel(int64_t block, float* to) const {
    const int64_t words = K / kWordDepth, group_words = group / kWordDepth;
    const uint32_t* panel = w + block * words * kCols;
    for (int64_t word = 0; word < words; ++word) {
      const int64_t at = word / group_words * N + block * kCols;
      VLLM_XLA_UNROLL_INT4
      for (int h = 0; h < 2; ++h) {
        const __m256i words8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + word * kCols + h * 8));
        const __m256 s = _mm256_loadu_ps(scale + at + h * 8), b = Base(s, at + h * 8);
        VLLM_XLA_UNROLL_INT4
        for (int k = 0; k < kWordDepth; ++k) {
          _mm256_storeu_ps(to + (word * kWordDepth + k) * kCols + h * 8, _mm256_fmadd_ps(Widen(words8, k), s, b));
        }
      }
    }
  }

  using BlockKernel = void (*)(const Int4Problem&, int64_t, int64_t);
  static constexpr BlockKernel kFloatKernels[kFloatRows] = {&FloatBlock<1>, &FloatBlock<2>, &FloatBlock<3>};
  static constexpr BlockKernel kFixedKernels[kFixedRows] = {&FixedPointBlock<1>, &FixedPointBlock<2>};
#undef VLLM_XLA_UNROLL_INT4
#undef VLLM_XLA_INT4_AVX2
#endif  // __x86_64__
};

struct PortableInt4 : Int4Problem {
  void Run(const Item& item) const {
    WalkRegisterBlocks(item, M, K * sizeof(float), kFloatRows, 1,
                       [&](int64_t row, int rows, int64_t block, int) { PortableBlock(row, rows, block); });
  }
};

#if defined(__x86_64__)
struct Avx2Int4 : Int4Problem {
  void Run(const Item& item) const {
    if (M > kWidenAheadAbove) return RunWidened(item);
    if (fixed != nullptr) {
      return WalkRegisterBlocks(item, M, K * 2, kFixedRows, 1, [&](int64_t row, int rows, int64_t block, int) {
        kFixedKernels[rows - 1](*this, row, block);
      });
    }
    WalkRegisterBlocks(item, M, K * sizeof(float), kFloatRows, 1,
                       [&](int64_t row, int rows, int64_t block, int) { kFloatKernels[rows - 1](*this, row, block); });
  }

  // Many rows: each column panel dequantized to float32 once per chunk of rows.
  void RunWidened(const Item& item) const {
    std::vector<float> panel(K * kCols);
    int64_t widened = -1;  // the column block `panel` holds
    WalkRegisterBlocks(item, M, K * sizeof(float), vllm_xla::kF32BlockRows, 1,
                       [&](int64_t row, int rows, int64_t block, int) {
                         if (block != widened) {
                           DequantizePanel(block, panel.data());
                           widened = block;
                         }
                         vllm_xla::F32BlockFor(rows)(x + row * K, panel.data(), K, y + row * N + block * kCols, N);
                       });
  }
};

// Many rows of bfloat16 x on AVX-512 BF16: each panel of the item dequantized once to bfloat16
// pairs into the thread's scratch (the item sized so that they stay in L2) by the first register
// block over its column group (`WidenInt4Block`, which multiplies them as it goes), then the other
// rows on the bfloat16 kernel's register blocks over the pairs.
// Runs `problem.RunWith(item, scales, offsets)` on the scales as the call holds them: float16 bits
// (`half_scale`, `half_offset`), read as they are, or float32.
template <typename Problem>
void RunWithScales(const Problem& problem, const Item& item) {
  if (problem.half_scale != nullptr) return problem.RunWith(item, problem.half_scale, problem.half_offset);
  problem.RunWith(item, problem.scale, problem.offset);
}

struct Avx512Bf16Int4 : Int4Problem {
  const uint16_t* x_bits;       // [M, K] bfloat16
  const uint16_t* half_scale;   // float16 bits of the scales (then `scale` and `offset` are null), or null
  const uint16_t* half_offset;  // float16 bits of the offsets, or null

  void Run(const Item& item) const { RunWithScales(*this, item); }

  template <typename Scale>
  void RunWith(const Item& item, const Scale* scales, const Scale* offsets) const {
    const int64_t panel = K * kCols;
    uint16_t* pairs = vllm_xla::ThreadPairs((item.end_block - item.first_block) * panel);
    int64_t widened_end = item.first_block;  // blocks before it are in `pairs`
    WalkRegisterBlocks(item, M, K * sizeof(uint16_t), vllm_xla::kBf16VectorRows, vllm_xla::kBf16VectorBlocks,
                       [&](int64_t row, int rows, int64_t block, int blocks) {
                         if (block < widened_end) {
                           return vllm_xla::Bf16VectorBlockFor(rows, blocks)(
                               x_bits + row * K, pairs + (block - item.first_block) * panel, panel, K,
                               y + row * N + block * kCols, N);
                         }
                         while (widened_end < block + blocks) {  // the first rows over these blocks
                           const int widening = static_cast<int>(
                               std::min<int64_t>(vllm_xla::kInt4WidenBlocks, block + blocks - widened_end));
                           WidenAndMultiply<Scale>(widened_end, widening, row, rows, scales, offsets,
                                                   pairs + (widened_end - item.first_block) * panel);
                           widened_end += widening;
                         }
                       });
  }

  // Rows [row, row + rows) times column blocks [block, block + blocks) (up to kInt4WidenBlocks),
  // their panels widened into `to` on the way (`WidenInt4Block`).
  template <typename Scale>
  void WidenAndMultiply(int64_t block, int blocks, int64_t row, int rows, const Scale* scales, const Scale* offsets,
                        uint16_t* to) const {
    const int64_t column = block * kCols;
    const vllm_xla::Int4Panels<Scale> panels{w + block * (K / kWordDepth) * kCols, scales + column,
                                             offsets != nullptr ? offsets + column : nullptr, scale_in_base, N, K,
                                             group};
    vllm_xla::WidenInt4BlockFor<Scale>(rows, blocks)(panels, x_bits + row * K, to, K * kCols,
                                                     y + row * N + column, N);
  }
};
#endif

}  // namespace int4
}  // namespace vllm_xla
