// SPDX-License-Identifier: Apache-2.0
// Register blocks of the CPU attention (AVX-512). Prefill: the scores of several query vectors
// against a 16-key panel, the panel itself (a register transpose), and the probability-weighted
// values of several heads; done a vector or a head at a time, each multiply-add also loads an
// operand of its own, in blocks one load serves the whole block. Decode: one query's scores
// against 16 keys as stored, summed across lanes together.
#pragma once

#include <cstdint>
#include <type_traits>

#include "dense_avx512_bf16.h"
#include "kv_values.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace vllm_xla {

constexpr int kScoreBlock = 8;

// sc[b * stride + j] = the dot of query vector b (`q + b * D`) with key j of a 16-key panel
// (`panel`: [D, 16]), for b < kScoreBlock.
inline void ScoreBlock(const float* q, int64_t D, const float* panel, float* sc, int64_t stride) {
  __m512 sum[kScoreBlock];
  for (int b = 0; b < kScoreBlock; ++b) sum[b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 keys = _mm512_loadu_ps(panel + d * 16);
    for (int b = 0; b < kScoreBlock; ++b) sum[b] = _mm512_fmadd_ps(_mm512_set1_ps(q[b * D + d]), keys, sum[b]);
  }
  for (int b = 0; b < kScoreBlock; ++b) _mm512_storeu_ps(sc + b * stride, sum[b]);
}

// acc[h * kD + d] += sum over keys j0..j1 of p[h * stride + j] * values[j * kD + d], for kH heads;
// their accumulators stay in registers (kH * kD / 16 of them, plus kD / 16 for a value row), and
// each value row is widened once for all kH heads (`values`: float32 scratch, or a page as stored).
// `upcoming` (or none): a block of the values' shape that the caller reads next, loaded into L2 a
// row with each key, so its loads spread over the loop instead of filling the miss queue at once.
template <int kH, int kD, typename T>
void AccumulateValueHeads(const float* p, int64_t stride, const T* values, int64_t j0, int64_t j1, float* acc,
                          const T* upcoming = nullptr) {
  static_assert(kD % 16 == 0 && (kH + 1) * kD / 16 <= 32, "the block must fit in the 32 vector registers");
  constexpr int kC = kD / 16;
  __m512 sum[kH][kC];
  for (int h = 0; h < kH; ++h) {
    for (int c = 0; c < kC; ++c) sum[h][c] = _mm512_loadu_ps(acc + h * kD + 16 * c);
  }
  for (int64_t j = j0; j < j1; ++j) {
    __m512 probability[kH];
    for (int h = 0; h < kH; ++h) probability[h] = _mm512_set1_ps(p[h * stride + j]);
    if (upcoming != nullptr) LoadIntoL2(upcoming + j * kD, kD);
    for (int c = 0; c < kC; ++c) {
      const __m512 v = Load16(values + j * kD + 16 * c);
      for (int h = 0; h < kH; ++h) sum[h][c] = _mm512_fmadd_ps(probability[h], v, sum[h][c]);
    }
  }
  for (int h = 0; h < kH; ++h) {
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(acc + h * kD + 16 * c, sum[h][c]);
  }
}

// One vector whose lane j is the sum of x[j]'s 16 lanes: a tree of 128-bit and in-lane shuffles
// (46 operations for the 16 sums; a reduction a vector is about 8 in a dependent chain).
inline __m512 SumLanes16(const __m512 (&x)[16]) {
  __m512 pairs[8];  // 128-bit lanes 0-1: partial sums of x[2i], 2-3: of x[2i + 1]
  for (int i = 0; i < 8; ++i) {
    const __m512 a = x[2 * i], b = x[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  __m512 quads[4];  // 128-bit lane t: four partial sums of x[4i + t]
  for (int i = 0; i < 4; ++i) {
    const __m512 a = pairs[2 * i], b = pairs[2 * i + 1];
    quads[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  const __m512 lo = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]), _mm512_unpackhi_ps(quads[0], quads[1]));
  const __m512 hi = _mm512_add_ps(_mm512_unpacklo_ps(quads[2], quads[3]), _mm512_unpackhi_ps(quads[2], quads[3]));
  const __m512d lo_d = _mm512_castps_pd(lo), hi_d = _mm512_castps_pd(hi);
  // Element 4t + k of `sums` is the sum of x[4k + t].
  const __m512 sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo_d, hi_d)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(lo_d, hi_d)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// Transposes 16 rows of 16 values in registers: r[i][k] becomes r[k][i] (64 shuffles; element by
// element it is 256 scalar loads and stores).
inline void Transpose16x16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // 128-bit lane L of t[2i]: r[2i][4L], r[2i+1][4L], r[2i][4L+1], r[2i+1][4L+1]
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L of r[4i + e]: column 4L + e of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  __m512 out[16];
  for (int e = 0; e < 4; ++e) {  // a 4x4 transpose of 128-bit lanes gives columns 4L + e
    const __m512 u0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x44), u1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xEE);
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x44);
    const __m512 u3 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xEE);
    out[e] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    out[4 + e] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
    out[8 + e] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    out[12 + e] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = out[i];
}

// 16 keys of a page (`keys`: [16, kD] as stored) as a float32 16-key panel `[kD, 16]`.
template <int kD, typename T>
inline void KeyPanel16(const T* keys, float* panel) {
  for (int c = 0; c < kD / 16; ++c) {
    __m512 r[16];
    for (int k = 0; k < 16; ++k) r[k] = Load16(keys + k * kD + 16 * c);
    Transpose16x16(r);
    for (int d = 0; d < 16; ++d) _mm512_storeu_ps(panel + (16 * c + d) * 16, r[d]);
  }
}

// The dots of query vector `q` (kD float32) with 16 consecutive keys of a page (`keys`: [16, kD]
// as stored): kD / 16 multiply-adds a key, summed across lanes for all 16 together.
template <int kD, typename T>
inline __m512 Dots16(const float* q, const T* keys) {
  constexpr int kC = kD / 16;
  __m512 query[kC], dot[16];
  for (int c = 0; c < kC; ++c) query[c] = _mm512_loadu_ps(q + 16 * c);
  for (int k = 0; k < 16; ++k) {
    dot[k] = _mm512_mul_ps(query[0], Load16(keys + k * kD));
    for (int c = 1; c < kC; ++c) dot[k] = _mm512_fmadd_ps(query[c], Load16(keys + k * kD + 16 * c), dot[k]);
  }
  return SumLanes16(dot);
}

// `Dots16` of a bfloat16 query (`q`: kD bits) with 16 bfloat16 keys, VDPBF16PS on pairs of values
// as stored (no widening): exact products, float32 sums.
template <int kD>
VLLM_XLA_AVX512BF16 inline __m512 Bf16Dots16(const uint16_t* q, const uint16_t* keys) {
  static_assert(kD % 32 == 0, "whole vectors of 32 bfloat16 values");
  constexpr int kC = kD / 32;
  __m512i query[kC];
  __m512 dot[16];
  for (int c = 0; c < kC; ++c) query[c] = _mm512_loadu_si512(q + 32 * c);
  for (int k = 0; k < 16; ++k) {
    dot[k] = _mm512_setzero_ps();
    for (int c = 0; c < kC; ++c) {
      dot[k] = _mm512_dpbf16_ps(dot[k], (__m512bh)query[c], (__m512bh)_mm512_loadu_si512(keys + k * kD + 32 * c));
    }
  }
  return SumLanes16(dot);
}

// Decode scores sc[g * stride + j] of G query heads (`q`: [G, kD] float32, scaled) against the
// keys of a page ([S, kD] as stored) in whole 16-key groups from j0's to j1's; with `q_bits`
// (bfloat16 keys only: [G, kD] unscaled bfloat16 queries) by VDPBF16PS, then scaled. `upcoming` (or
// none): a block of the keys' shape read next, loaded into L2 16 rows with the first head's 16 keys.
template <int kD, typename T>
void DecodeScores(const float* q, const uint16_t* q_bits, float scale, const T* keys, int64_t j0, int64_t j1,
                  int64_t G, float* sc, int64_t stride, const T* upcoming = nullptr) {
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = j0 / 16 * 16; j < j1; j += 16) {
      if (g == 0 && upcoming != nullptr) LoadIntoL2(upcoming + j * kD, 16 * kD);
      __m512 dots;
      if constexpr (std::is_same_v<T, uint16_t>) {
        dots = q_bits != nullptr
                   ? _mm512_mul_ps(Bf16Dots16<kD>(q_bits + g * kD, keys + j * kD), _mm512_set1_ps(scale))
                   : Dots16<kD>(q + g * kD, keys + j * kD);
      } else {
        dots = Dots16<kD>(q + g * kD, keys + j * kD);
      }
      _mm512_storeu_ps(sc + g * stride + j, dots);
    }
  }
}

}  // namespace vllm_xla
#endif
