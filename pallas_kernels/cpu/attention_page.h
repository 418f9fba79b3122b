// SPDX-License-Identifier: Apache-2.0
// The page step of the CPU attention (`paged_attention.cc`): the online-softmax update of a block
// of query heads with the visible keys of one page. A single row (decode) scores the page as
// stored: float32 and bfloat16 keys 16 at a time (bfloat16 queries against a bfloat16 cache by
// VDPBF16PS), float8 keys a key at a time; a block of rows (prefill) converts the page to float32
// panels once and scores all its rows against them (`attention_blocks.h` holds the register
// blocks of both). `paged_attention.cc` walks the pages and the work items.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_blocks.h"
#include "dense_f32_block.h"
#include "fast_math.h"
#include "kv_values.h"

namespace vllm_xla {
// Internal linkage, as when this lived in `paged_attention.cc` (its only includer): the compiler
// inlines the page step into each walk as it did there.
namespace {

constexpr float kMaskValue = -1e30f;
constexpr int64_t kMaxHeadDim = 1024;

struct Shapes {
  int64_t num_tokens, num_heads, head_dim;      // q [T, H, D]
  int64_t num_kv_heads, num_pages, page_size;   // cache [num_pages, 2K, S * D]
  int64_t num_slots, pages_per_seq;             // page_indices [R, P]
};

struct Params {
  float sm_scale;
  int32_t sliding_window;   // 0: none
  float soft_cap;           // 0: none
  int32_t attention_chunk;  // 0: none
};

// The page math of one attention call over a cache of element type T. kD > 0 fixes the head dim at
// compile time (the common sizes), so the loops over it unroll and vectorize; 0 reads it at run time.
template <typename T, int kD>
struct PageUpdate {
  Shapes s;
  Params prm;

  int64_t HeadDim() const { return kD > 0 ? kD : s.head_dim; }

  // Online-softmax update of one row's G query heads (q, acc: [G, D]; m, denom: [G]) with keys
  // j0..j1 of one page; each key and value is converted once for all G heads.
  // `q_bits`: the G heads' unscaled bfloat16 query when `bf16_dots`, else unused. `after_keys`,
  // `after_values`: the blocks of a page's shape that the walk reads after these keys and after
  // these values, loaded ahead while they are read (the decode update of whole 16-key groups), or
  // none.
  void Update(const float* q_row, const uint16_t* q_bits, const T* k_page, const T* v_page, float* acc, float* m,
              float* denom, int64_t j0, int64_t j1, int64_t G, float* sc, const T* after_keys = nullptr,
              const T* after_values = nullptr) const {
#if defined(__AVX512F__)
    if constexpr (kD > 0 && kD % 16 == 0) {
      if (s.page_size % 16 == 0) {
        UpdateDecode(q_row, q_bits, k_page, v_page, acc, m, denom, j0, j1, G, sc, after_keys, after_values);
      } else {
        UpdateVectors<Avx512>(q_row, k_page, v_page, acc, m, denom, j0, j1, G, sc);
      }
      return;
    }
#elif defined(VLLM_XLA_AVX2_DECODE)
    if constexpr (kD > 0 && kD % 8 == 0) {
      UpdateVectors<Avx2>(q_row, k_page, v_page, acc, m, denom, j0, j1, G, sc);
      return;
    }
#endif
    const int64_t D = HeadDim(), S = s.page_size;
    float kv[kD > 0 ? kD : kMaxHeadDim];
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t d = 0; d < D; ++d) kv[d] = Load(k_page + j * D, d);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q_row + g * D;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kv[d];
        if (prm.soft_cap > 0.0f) dot = prm.soft_cap * std::tanh(dot / prm.soft_cap);
        sc[g * S + j] = dot;
      }
    }
    Rescale(acc, m, denom, j0, j1, G, sc, S);
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t d = 0; d < D; ++d) kv[d] = Load(v_page + j * D, d);
      for (int64_t g = 0; g < G; ++g) {
        const float p = sc[g * S + j];
        float* ag = acc + g * D;
        for (int64_t d = 0; d < D; ++d) ag[d] += p * kv[d];
      }
    }
  }

#if defined(__AVX512F__) || defined(VLLM_XLA_AVX2_DECODE)
  // `Update` in vectors of V::kLanes along the head dim: a key's dot with each head is
  // kD / kLanes FMAs and one horizontal sum (a scalar loop would be one chain of D dependent
  // adds), and each head's accumulator stays in registers over the page's values.
  template <class V>
  void UpdateVectors(const float* q_row, const T* k_page, const T* v_page, float* acc, float* m,
                     float* denom, int64_t j0, int64_t j1, int64_t G, float* sc) const {
    constexpr int kW = V::kLanes, kC = kD / kW;
    const int64_t S = s.page_size;
    ScoreByKey<V>(q_row, k_page, j0, j1, G, sc);
    Rescale(acc, m, denom, j0, j1, G, sc, S);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = sc + g * S;
      float* ag = acc + g * kD;
      typename V::Reg sum[kC];
      for (int c = 0; c < kC; ++c) sum[c] = V::LoadF(ag + kW * c);
      for (int64_t j = j0; j < j1; ++j) {
        const typename V::Reg p = V::Set1(pg[j]);
        for (int c = 0; c < kC; ++c) sum[c] = V::Fmadd(p, V::Load(v_page + j * kD + kW * c), sum[c]);
      }
      for (int c = 0; c < kC; ++c) V::Store(ag + kW * c, sum[c]);
    }
  }

  // Scores sc[g * S + j] (soft cap applied) of G heads against keys j0..j1, a key at a time: each
  // key widened once for all heads. `upcoming` (or none): a block of the keys' shape read next,
  // loaded into L2 a row with each key.
  template <class V>
  void ScoreByKey(const float* q_row, const T* k_page, int64_t j0, int64_t j1, int64_t G, float* sc,
                  const T* upcoming = nullptr) const {
    constexpr int kW = V::kLanes, kC = kD / kW;
    const int64_t S = s.page_size;
    for (int64_t j = j0; j < j1; ++j) {
      if (upcoming != nullptr) LoadIntoL2(upcoming + j * kD, kD);
      typename V::Reg key[kC];
      for (int c = 0; c < kC; ++c) key[c] = V::Load(k_page + j * kD + kW * c);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q_row + g * kD;
        typename V::Reg dot = V::Mul(V::LoadF(qg), key[0]);
        for (int c = 1; c < kC; ++c) dot = V::Fmadd(V::LoadF(qg + kW * c), key[c], dot);
        float score = V::Sum(dot);
        if (prm.soft_cap > 0.0f) score = prm.soft_cap * std::tanh(score / prm.soft_cap);
        sc[g * S + j] = score;
      }
    }
  }
#endif

#if defined(__AVX512F__)
  // `Update` for pages of whole 16-key groups: float32 and bfloat16 keys scored a head and 16 keys
  // at a time (`Dots16`, one cross-lane sum for the 16; bfloat16 queries against a bfloat16 cache
  // by VDPBF16PS, unwidened), float8 keys a key at a time (widened once for all heads); each value
  // row widened once for all heads. Keys of a group past j1 are scored and never read.
  void UpdateDecode(const float* q_row, const uint16_t* q_bits, const T* k_page, const T* v_page, float* acc,
                    float* m, float* denom, int64_t j0, int64_t j1, int64_t G, float* sc, const T* after_keys,
                    const T* after_values) const {
    const int64_t S = s.page_size;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
      DecodeScores<kD>(q_row, q_bits, prm.sm_scale, k_page, j0, j1, G, sc, S, after_keys);
      if (prm.soft_cap > 0.0f) {
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t j = j0; j < j1; ++j) sc[g * S + j] = prm.soft_cap * std::tanh(sc[g * S + j] / prm.soft_cap);
        }
      }
    } else {
      ScoreByKey<Avx512>(q_row, k_page, j0, j1, G, sc, after_keys);
    }
    Rescale(acc, m, denom, j0, j1, G, sc, S);
    AccumulateHeads(sc, S, v_page, j0, j1, G, acc, after_values);
  }
#endif

  // acc[g * D + d] += sum over keys j0..j1 of p[g * stride + j] * values[j * D + d] for G heads;
  // with AVX-512 in blocks of heads that share each value row (`values`: float32, or a page as
  // stored, whose rows are widened once a block); `upcoming`: a block of the values' shape that the
  // walk reads next, loaded ahead as the values are summed (`AccumulateValueHeads`), or none.
  template <typename U>
  void AccumulateHeads(const float* p, int64_t stride, const U* values, int64_t j0, int64_t j1, int64_t G,
                       float* acc, const U* upcoming = nullptr) const {
    const int64_t D = HeadDim();
    int64_t g = 0;
#if defined(__AVX512F__)
    // Heads in threes, else pairs, while their accumulators and a value row fit in 32 registers.
    const U* ahead = upcoming;  // loaded by the first block only: each block reads every value row
    if constexpr (kD > 0 && kD % 16 == 0 && kD <= 64) {
      for (; g + 3 <= G; g += 3, ahead = nullptr) {
        AccumulateValueHeads<3, kD>(p + g * stride, stride, values, j0, j1, acc + g * D, ahead);
      }
    }
    if constexpr (kD > 0 && kD % 16 == 0 && kD <= 128) {
      for (; g + 2 <= G; g += 2, ahead = nullptr) {
        AccumulateValueHeads<2, kD>(p + g * stride, stride, values, j0, j1, acc + g * D, ahead);
      }
    }
    if constexpr (kD > 0 && kD % 16 == 0) {
      for (; g < G; ++g, ahead = nullptr) {
        AccumulateValueHeads<1, kD>(p + g * stride, stride, values, j0, j1, acc + g * D, ahead);
      }
    }
#endif
    if constexpr (std::is_same_v<U, float>) {
      for (; g < G; ++g) AccumulateValues(p + g * stride, values, j0, j1, acc + g * D);
    }
  }

  // Softmax bookkeeping shared by both updates: scores `sc[g * stride + j]` for keys j0..j1 (soft cap
  // applied) become probabilities; each head's running max, sum and accumulator are rescaled.
  void Rescale(float* acc, float* m, float* denom, int64_t j0, int64_t j1, int64_t G, float* sc,
               int64_t stride) const {
    const int64_t D = HeadDim();
    for (int64_t g = 0; g < G; ++g) {
      float* scg = sc + g * stride;
      const float page_max = MaxOf(scg, j0, j1, kMaskValue);
      const float m_new = std::max(m[g], page_max);
      const float alpha = ExpNonPositive(m[g] - m_new);
      float sum = 0.0f;
      for (int64_t j = j0; j < j1; ++j) {
        scg[j] = ExpNonPositive(scg[j] - m_new);
        sum += scg[j];
      }
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
      denom[g] = denom[g] * alpha + sum;
      m[g] = m_new;
    }
  }

  // acc[d] += sum over keys j0..j1 of p[j] * values[j * D + d] (AVX-512: `AccumulateHeads`); with
  // AVX2 the accumulator stays in registers when the head dim is a compile-time multiple of 64.
  void AccumulateValues(const float* p, const float* values, int64_t j0, int64_t j1, float* acc) const {
#if defined(VLLM_XLA_AVX2_DECODE)
    if constexpr (kD > 0 && kD % 64 == 0) {  // 64 columns at a time: 8 accumulators in registers
      for (int64_t c0 = 0; c0 < kD; c0 += 64) {
        __m256 sum[8];
        for (int k = 0; k < 8; ++k) sum[k] = _mm256_loadu_ps(acc + c0 + 8 * k);
        for (int64_t j = j0; j < j1; ++j) {
          const __m256 pj = _mm256_set1_ps(p[j]);
          for (int k = 0; k < 8; ++k) {
            sum[k] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(values + j * kD + c0 + 8 * k), sum[k]);
          }
        }
        for (int k = 0; k < 8; ++k) _mm256_storeu_ps(acc + c0 + 8 * k, sum[k]);
      }
      return;
    }
#endif
    const int64_t D = HeadDim();
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * values[j * D + d];
    }
  }

  // dots[j] = sum over d of q[d] * keys[d * stride + j], for 16 keys j.
  void Dot16(const float* q_head, const float* keys, int64_t stride, float* dots) const {
#if defined(__AVX512F__)
    // Four partial sums: one chain of D dependent FMAs would wait on each one's latency.
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t D = HeadDim();
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
      for (int u = 0; u < 4; ++u) {
        sum[u] = _mm512_fmadd_ps(_mm512_set1_ps(q_head[d + u]), _mm512_loadu_ps(keys + (d + u) * stride), sum[u]);
      }
    }
    for (; d < D; ++d) {
      sum[0] = _mm512_fmadd_ps(_mm512_set1_ps(q_head[d]), _mm512_loadu_ps(keys + d * stride), sum[0]);
    }
    _mm512_storeu_ps(dots, _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
#else
    float sum[16] = {};
    for (int64_t d = 0; d < HeadDim(); ++d) {
      for (int64_t j = 0; j < 16; ++j) sum[j] += q_head[d] * keys[d * stride + j];
    }
    std::memcpy(dots, sum, sizeof(sum));
#endif
  }

  // The page size rounded up to whole vectors of 16 keys.
  int64_t PaddedPageSize() const { return (s.page_size + 15) / 16 * 16; }

  // Converts keys 0..n of a page to float32 16-key panels `[S16 / 16, D, 16]` and values to
  // `[S, D]` (float32 values are read in place: not copied), once for a block; with AVX-512, whole
  // 16-key groups by register transposes.
  void ConvertPage(const T* k_page, const T* v_page, int64_t n, float* keys, float* values) const {
    constexpr bool kCopyValues = !std::is_same_v<T, float>;
#if defined(__AVX512F__)
    if constexpr (kD > 0 && kD % 16 == 0) {
      if (s.page_size % 16 == 0) {  // a group past n still lies in the page
        for (int64_t j = 0; j < n; j += 16) KeyPanel16<kD>(k_page + j * kD, keys + j * kD);
        if constexpr (kCopyValues) {
          for (int64_t i = 0; i < n * kD; i += 16) _mm512_storeu_ps(values + i, Load16(v_page + i));
        }
        return;
      }
    }
#endif
    const int64_t D = HeadDim();
    for (int64_t j = 0; j < n; ++j) {
      float* key_column = keys + (j / 16) * D * 16 + j % 16;
      for (int64_t d = 0; d < D; ++d) key_column[d * 16] = Load(k_page + j * D, d);
      if constexpr (kCopyValues) {
        for (int64_t d = 0; d < D; ++d) values[j * D + d] = Load(v_page + j * D, d);
      }
    }
  }

  // The scores of `count` query vectors (q: [count, D]) against the panels of a converted page
  // that hold its first `n` keys (all 16 of each): sc [count, S16], columns past those panels
  // left as they were. With AVX2, blocks of up to 6 vectors by a 16-key panel accumulate in
  // registers, as a dense layer's rows against a weight panel.
  void ScoreConverted(const float* q_vectors, int64_t count, const float* keys, int64_t n, float* sc) const {
    const int64_t D = HeadDim(), S16 = PaddedPageSize();
    for (int64_t j16 = 0; j16 < n; j16 += 16) {
      const float* panel = keys + j16 * D;
#if defined(VLLM_XLA_AVX2_DECODE)
      for (int64_t i = 0; i < count; i += kF32BlockRows) {
        const int block = static_cast<int>(std::min<int64_t>(kF32BlockRows, count - i));
        F32BlockFor(block)(q_vectors + i * D, panel, D, sc + i * S16 + j16, S16);
      }
#else
      int64_t i = 0;
#if defined(__AVX512F__)
      constexpr int kBlock = kScoreBlock;
      for (; i + kBlock <= count; i += kBlock) ScoreBlock(q_vectors + i * D, D, panel, sc + i * S16 + j16, S16);
#endif
      for (; i < count; ++i) Dot16(q_vectors + i * D, panel, 16, sc + i * S16 + j16);
#endif
    }
  }

  // `Update` from a converted page whose scores `sc` ([G, S16]) are computed.
  void UpdateScored(const float* values, float* acc, float* m, float* denom, int64_t j0, int64_t j1, int64_t G,
                    float* sc) const {
    const int64_t S16 = PaddedPageSize();
    if (prm.soft_cap > 0.0f) {
      for (int64_t g = 0; g < G; ++g) {
        float* scg = sc + g * S16;
        for (int64_t j = j0; j < j1; ++j) scg[j] = prm.soft_cap * std::tanh(scg[j] / prm.soft_cap);
      }
    }
    Rescale(acc, m, denom, j0, j1, G, sc, S16);
    AccumulateHeads(sc, S16, values, j0, j1, G, acc);
  }
};

}  // namespace
}  // namespace vllm_xla
