// SPDX-License-Identifier: Apache-2.0
// Register blocks of the CPU attention's prefill path (AVX-512): the scores of several query
// vectors against a 16-key panel, and the probability-weighted values of several heads. Done a
// vector or a head at a time, each multiply-add also loads an operand of its own; in blocks one
// load serves the whole block.
#pragma once

#include <cstdint>

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
// their accumulators stay in registers (kH * kD / 16 of them, plus kD / 16 for a value row).
template <int kH, int kD>
void AccumulateValueHeads(const float* p, int64_t stride, const float* values, int64_t j0, int64_t j1,
                          float* acc) {
  static_assert(kD % 16 == 0 && (kH + 1) * kD / 16 <= 32, "the block must fit in the 32 vector registers");
  constexpr int kC = kD / 16;
  __m512 sum[kH][kC];
  for (int h = 0; h < kH; ++h) {
    for (int c = 0; c < kC; ++c) sum[h][c] = _mm512_loadu_ps(acc + h * kD + 16 * c);
  }
  for (int64_t j = j0; j < j1; ++j) {
    __m512 probability[kH];
    for (int h = 0; h < kH; ++h) probability[h] = _mm512_set1_ps(p[h * stride + j]);
    for (int c = 0; c < kC; ++c) {
      const __m512 v = _mm512_loadu_ps(values + j * kD + 16 * c);
      for (int h = 0; h < kH; ++h) sum[h][c] = _mm512_fmadd_ps(probability[h], v, sum[h][c]);
    }
  }
  for (int h = 0; h < kH; ++h) {
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(acc + h * kD + 16 * c, sum[h][c]);
  }
}

}  // namespace vllm_xla
#endif
