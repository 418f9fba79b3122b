// SPDX-License-Identifier: Apache-2.0
// The AVX-512 VNNI path of the int8 dense kernel (dense_int8.cc): x in 16-bit fixed point, the
// products in int32 with VPDPBUSD (64 byte products an instruction).
//
// Each row of x is quantized once per call: sx = max|x_row| / 32639, x16 = rint(x / sx) in
// [-32639, 32639], split into two signed byte planes, x16 = 256 hi + lo (lo the sign-extended low
// byte, so |hi| <= 127 and lo in [-128, 127]). VPDPBUSD multiplies unsigned bytes by signed ones,
// so the weights enter as u = q + 128 (q XOR 0x80) and each row's plane sums correct the offset:
// sum_k u_kn p_k = sum_k q_kn p_k + 128 sum_k p_k. The sums wrap modulo 2^32 alike, so the
// corrected int32 values are exact whenever |sum_k q_kn p_k| <= 128 * 128 K fits, K <= 131072
// (`kMaxVnniDepth`). Then y = sx s[n] (256 T_hi + T_lo) in float32. The one error next to the
// float product is x's rounding to 16 bits: |y - (x @ q) s| <= s[n] sx / 2 sum_k |q_kn|.
//
// The packed weight stays `[N/16, K, 16]`: four consecutive panel rows (64 bytes: 4 k by 16
// columns) become the VPDPBUSD layout (16 columns by 4 k) with one byte permutation (VPERMB) in
// registers, which runs beside the multiplies, so prepared weights keep one layout for every path.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "dense_blocks.h"

namespace vllm_xla {

#define VLLM_XLA_INT8_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))
// Register blocks unroll whole: an accumulator array indexed in a loop would live in memory.
#define VLLM_XLA_UNROLL _Pragma("GCC unroll 16")

constexpr int64_t kMaxVnniDepth = 131072;    // int32 holds |sum_k q p| <= 128 * 128 * K
constexpr int kVnniRows = 6;                 // rows of x in a register block
constexpr int kVnniBlocks = 4;               // 16-column blocks in a register block
constexpr float kVnniLevels = 32639.0f;      // |x16| <= 32639: both planes fit a signed byte
constexpr float kSmallestVnniMax = 1e-30f;   // below: sx would lose precision (subnormal)

// Whether this CPU has AVX-512 VNNI and VBMI (besides F and BW).
inline bool Avx512VnniUsable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}

// x's rows in the fixed point above: the byte planes of k, k+1, k+2, k+3 packed in one 32-bit
// word (VPDPBUSD's broadcast operand), K rounded up to a multiple of 4 with zeros.
struct FixedPointRows {
  int64_t words = 0;              // per row: ceil(K / 4)
  int64_t groups = 1;             // runs of k with their own scales
  std::vector<int32_t> hi, lo;    // [M, words]
  std::vector<int32_t> hi_sum, lo_sum;  // [M, groups]: 128 * the plane's sum over the group's k
  std::vector<float> step;        // [M]: sx

  // Quantizes the first M rows of x (float32 values, or bfloat16 ones when `Value` is uint16_t;
  // row stride K); false, leaving the rest undone, if a row holds a value that is not finite or
  // its largest magnitude is positive but below `kSmallestVnniMax` (then the float path must run).
  // With `group` < K (a multiple of 4 that divides K) the plane sums are kept per group.
  template <typename Value>
  bool Quantize(const Value* x, int64_t M, int64_t K, int64_t group) {
    words = (K + 3) / 4, groups = K / group;
    hi.assign(M * words, 0), lo.assign(M * words, 0);
    hi_sum.assign(M * groups, 0), lo_sum.assign(M * groups, 0), step.assign(M, 0.0f);
    for (int64_t m = 0; m < M; ++m) {
      float largest;
      if (!Largest(x + m * K, K, largest) || (largest > 0.0f && largest < kSmallestVnniMax)) return false;
      if (largest == 0.0f) continue;  // zero planes, sx = 0
      const auto planes = Split(x + m * K, K, kVnniLevels / largest, reinterpret_cast<int8_t*>(&hi[m * words]),
                                reinterpret_cast<int8_t*>(&lo[m * words]));
      hi_sum[m * groups] = 128 * planes.first, lo_sum[m * groups] = 128 * planes.second;
      if (groups > 1) GroupSums(m, group);
      step[m] = largest / kVnniLevels;
    }
    return true;
  }

 private:
  void GroupSums(int64_t m, int64_t group) {
    const auto* high = reinterpret_cast<const int8_t*>(&hi[m * words]);
    const auto* low = reinterpret_cast<const int8_t*>(&lo[m * words]);
    for (int64_t g = 0; g < groups; ++g) {
      int32_t high_total = 0, low_total = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) high_total += high[k], low_total += low[k];
      hi_sum[m * groups + g] = 128 * high_total, lo_sum[m * groups + g] = 128 * low_total;
    }
  }

  // 16 values of x from `at` (`present` of them) as float32 bits: bfloat16 is float32's high half.
  VLLM_XLA_INT8_VNNI static __m512i LoadBits(const float* at, __mmask16 present) {
    return _mm512_maskz_loadu_epi32(present, at);
  }
  VLLM_XLA_INT8_VNNI static __m512i LoadBits(const uint16_t* at, __mmask16 present) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(present, at)), 16);
  }

  static __mmask16 Present(int64_t K, int64_t k) {
    return K - k >= 16 ? 0xffff : static_cast<__mmask16>((1u << (K - k)) - 1);
  }

  // max |row| into `largest`; false if a value is not finite.
  template <typename Value>
  VLLM_XLA_INT8_VNNI static bool Largest(const Value* row, int64_t K, float& largest) {
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    __m512i most = _mm512_setzero_si512();  // the largest magnitude's bits (they order as the values)
    __mmask16 not_finite = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i bits = _mm512_and_si512(LoadBits(row + k, Present(K, k)), _mm512_set1_epi32(0x7fffffff));
      not_finite |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
      most = _mm512_max_epi32(most, bits);
    }
    const int32_t bits = _mm512_reduce_max_epi32(most);
    std::memcpy(&largest, &bits, sizeof(bits));
    return not_finite == 0;
  }

  // The row's byte planes (x16 = rint(x * inverse), ties to even) into `high` and `low`; returns
  // their sums.
  template <typename Value>
  VLLM_XLA_INT8_VNNI static std::pair<int32_t, int32_t> Split(const Value* row, int64_t K, float inverse,
                                                              int8_t* high, int8_t* low) {
    const __m512 scale = _mm512_set1_ps(inverse);
    const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(kVnniLevels));
    const __m512i bottom = _mm512_set1_epi32(-static_cast<int32_t>(kVnniLevels));
    __m512i high_sum = _mm512_setzero_si512(), low_sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 present = Present(K, k);
      const __m512 values = _mm512_castsi512_ps(LoadBits(row + k, present));
      const __m512i fixed = _mm512_min_epi32(
          top, _mm512_max_epi32(bottom, _mm512_cvt_roundps_epi32(_mm512_mul_ps(values, scale),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      const __m512i l = _mm512_srai_epi32(_mm512_slli_epi32(fixed, 24), 24);  // the sign-extended low byte
      const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(fixed, l), 8);
      high_sum = _mm512_add_epi32(high_sum, h), low_sum = _mm512_add_epi32(low_sum, l);
      _mm512_mask_cvtepi32_storeu_epi8(high + k, present, h);
      _mm512_mask_cvtepi32_storeu_epi8(low + k, present, l);
    }
    return {_mm512_reduce_add_epi32(high_sum), _mm512_reduce_add_epi32(low_sum)};
  }
};

// acc + the products of u's unsigned bytes with s's signed bytes, 4 to a 32-bit lane (VPDPBUSD). In
// assembly: GCC's intrinsic keeps large register blocks of accumulators in memory.
VLLM_XLA_INT8_VNNI inline __m512i DotBytes(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// 16 scales from `at` as float32: float32 ones as they are, float16 bits (`Scale` uint16_t: GGUF
// Q8_0's own d) widened exactly (VCVTPH2PS), half the bytes a decode step streams for them.
VLLM_XLA_INT8_VNNI inline __m512 LoadScales(const float* at) { return _mm512_loadu_ps(at); }
VLLM_XLA_INT8_VNNI inline __m512 LoadScales(const uint16_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

template <typename Scale>
struct VnniInt8 {
  const FixedPointRows* rows;
  const int8_t* w;     // [N/16, K, 16]
  const Scale* scale;  // [N], or [groups, N] (`FixedPointRows::groups`): float32, or float16 bits
  float* y;            // [M, N]
  int64_t M, K, N;

  static void Begin() {}
  static void End() {}

  // The VPERMB order that turns 64 panel bytes (4 k by 16 columns) into VPDPBUSD's layout (16
  // columns by 4 k).
  VLLM_XLA_INT8_VNNI static __m512i InterleaveOrder() {
    alignas(64) int8_t order[64];
    for (int i = 0; i < 64; ++i) order[i] = static_cast<int8_t>((i % 4) * 16 + i / 4);  // column i/4, k i%4
    return _mm512_load_si512(order);
  }

  // y[row : row + R, block * 16 : (block + C) * 16].
  // The int32 sums of a register block over words [first, end), plane by plane.
  template <int R, int C>
  VLLM_XLA_INT8_VNNI static void Accumulate(const VnniInt8& p, int64_t row, int64_t block, int64_t first,
                                            int64_t end, __m512i (&acc)[R][2 * C]) {
    const int64_t panel = p.K * 16, words = p.rows->words;
    const int8_t* w = p.w + block * panel;
    const int32_t* hi = p.rows->hi.data() + row * words;
    const int32_t* lo = p.rows->lo.data() + row * words;
    const __m512i order = InterleaveOrder();
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    // The last word of a K that is not a multiple of 4 loads only its k: zero bytes past K meet
    // zero planes.
    const int64_t full = p.K / 4;
    const __mmask64 last = full < words ? (~0ULL) >> (64 - 16 * (p.K - 4 * full)) : ~0ULL;
    for (int64_t word = first; word < end; ++word) {
      const __mmask64 present = word < full ? ~0ULL : last;
      __m512i weights[C];
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) {
        const __m512i bytes = _mm512_maskz_loadu_epi8(present, w + c * panel + word * 64);
        weights[c] = _mm512_xor_si512(_mm512_permutexvar_epi8(order, bytes), offset);
      }
      VLLM_XLA_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512i h = _mm512_set1_epi32(hi[r * words + word]);
        VLLM_XLA_UNROLL
        for (int c = 0; c < C; ++c) acc[r][c] = DotBytes(acc[r][c], weights[c], h);
        const __m512i l = _mm512_set1_epi32(lo[r * words + word]);
        VLLM_XLA_UNROLL
        for (int c = 0; c < C; ++c) acc[r][C + c] = DotBytes(acc[r][C + c], weights[c], l);
      }
    }
  }

  // 256 (high - its offset) + (low - its offset) of accumulator pair (r, c) for group g, in float32.
  template <int R, int C>
  VLLM_XLA_INT8_VNNI static __m512 Combine(const VnniInt8& p, int64_t row, int64_t g, int r, int c,
                                           const __m512i (&acc)[R][2 * C]) {
    const int64_t at = (row + r) * p.rows->groups + g;
    const __m512 high = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], _mm512_set1_epi32(p.rows->hi_sum[at])));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][C + c], _mm512_set1_epi32(p.rows->lo_sum[at])));
    return _mm512_fmadd_ps(high, _mm512_set1_ps(256.0f), low);
  }

  // y[row : row + R, block * 16 : (block + C) * 16], one scale per column.
  template <int R, int C>
  VLLM_XLA_INT8_VNNI static void Block(const VnniInt8& p, int64_t row, int64_t block) {
    __m512i acc[R][2 * C];  // [r][c]: the high plane's sums, [r][C + c]: the low plane's
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r)
      VLLM_XLA_UNROLL
      for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_setzero_si512();
    Accumulate<R, C>(p, row, block, 0, p.rows->words, acc);
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 step = _mm512_set1_ps(p.rows->step[row + r]);
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) {
        const __m512 s = _mm512_mul_ps(LoadScales(p.scale + (block + c) * 16), step);
        _mm512_storeu_ps(p.y + (row + r) * p.N + (block + c) * 16, _mm512_mul_ps(Combine<R, C>(p, row, 0, r, c, acc), s));
      }
    }
  }

  // The same with a scale per group of k and column (`scale` [K / group, N]): the int32 sums flush
  // into float32 ones, each group's sums times its scales, then sx at the store.
  template <int R, int C>
  VLLM_XLA_INT8_VNNI static void GroupedBlock(const VnniInt8& p, int64_t row, int64_t block) {
    const int64_t group_words = p.K / p.rows->groups / 4;
    __m512 total[R][C];
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r)
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) total[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < p.rows->groups; ++g) {
      __m512i acc[R][2 * C];
      VLLM_XLA_UNROLL
      for (int r = 0; r < R; ++r)
        VLLM_XLA_UNROLL
        for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_setzero_si512();
      Accumulate<R, C>(p, row, block, g * group_words, (g + 1) * group_words, acc);
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) {
        const __m512 s = LoadScales(p.scale + g * p.N + (block + c) * 16);
        VLLM_XLA_UNROLL
        for (int r = 0; r < R; ++r) total[r][c] = _mm512_fmadd_ps(Combine<R, C>(p, row, g, r, c, acc), s, total[r][c]);
      }
    }
    VLLM_XLA_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 step = _mm512_set1_ps(p.rows->step[row + r]);
      VLLM_XLA_UNROLL
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(p.y + (row + r) * p.N + (block + c) * 16, _mm512_mul_ps(total[r][c], step));
    }
  }

  using BlockKernel = void (*)(const VnniInt8&, int64_t, int64_t);

  // Register blocks of one row by one column block for one row (a decode step: the weights
  // stream from memory once, and one panel at a time is one stream of them; four panels at once,
  // four streams 16 K bytes apart, left the row waiting on memory, as on the int4 kernel), of up to
  // 3 rows by 4 column blocks for 2 or 3 rows, else 6 rows by 2 (fewer weight permutations per
  // product); those hold 24 accumulators (two planes). Grouped scales add float32 sums: 1 row by
  // 1 block, else 3 by 2.
  static BlockKernel KernelFor(bool grouped, int rows, int blocks) {
#define VLLM_XLA_WIDE(R) {&Block<R, 1>, &Block<R, 2>, &Block<R, 3>, &Block<R, 4>}
#define VLLM_XLA_TALL(R) {&Block<R, 1>, &Block<R, 2>, nullptr, nullptr}
    static constexpr BlockKernel kKernels[kVnniRows][kVnniBlocks] = {
        VLLM_XLA_WIDE(1), VLLM_XLA_WIDE(2), VLLM_XLA_WIDE(3), VLLM_XLA_TALL(4), VLLM_XLA_TALL(5), VLLM_XLA_TALL(6)};
    static constexpr BlockKernel kGrouped[3][kVnniBlocks] = {
        {&GroupedBlock<1, 1>, &GroupedBlock<1, 2>, &GroupedBlock<1, 3>, &GroupedBlock<1, 4>},
        {&GroupedBlock<2, 1>, &GroupedBlock<2, 2>, nullptr, nullptr},
        {&GroupedBlock<3, 1>, &GroupedBlock<3, 2>, nullptr, nullptr}};
#undef VLLM_XLA_WIDE
#undef VLLM_XLA_TALL
    return grouped ? kGrouped[rows - 1][blocks - 1] : kKernels[rows - 1][blocks - 1];
  }

  bool Grouped() const { return rows->groups > 1; }
  int BlockRows() const {
    if (Grouped()) return M <= 1 ? 1 : 3;
    return M <= 3 ? 3 : kVnniRows;
  }
  int BlockCols() const {
    if (M == 1) return 1;
    return !Grouped() && M <= 3 ? kVnniBlocks : 2;
  }

  void Run(const Item& item) const {
    const bool grouped = Grouped();
    WalkRegisterBlocks(item, M, rows->words * 8, BlockRows(), BlockCols(),
                       [&](int64_t row, int count, int64_t block, int blocks) {
                         KernelFor(grouped, count, blocks)(*this, row, block);
                       });
  }
};

}  // namespace vllm_xla

#endif  // __x86_64__
