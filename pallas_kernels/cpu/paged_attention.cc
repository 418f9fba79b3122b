// SPDX-License-Identifier: Apache-2.0
// Ragged paged attention for XLA:CPU as an XLA FFI handler.
//
// Same contract as the pure-jnp reference (pallas_kernels/reference.py), on the page-major cache of
// layout.py: `[num_pages, 2K, page_size * D]`, rows 0..K-1 of a page holding its K heads and
// K..2K-1 its V heads, float32, or bit patterns of bfloat16 (uint16) or float8 (e4m3fn, e5m2;
// uint8, unscaled; the `cache_format` attribute says which). Every query
// row attends to its own sequence's keys up to its position, page by page, with an online
// softmax, so the work follows the real context: padding rows and unused block-table entries cost
// nothing.
//
// Work items are (sequence, block of query rows, kv heads: all of them when there are enough
// items, else one); the caller's thread and XLA's intra-op pool take items from a shared counter
// until none is left.
//
// Attention sinks (GPT-OSS): a `[H]` float32 logit per query head that joins every row's softmax
// denominator and attends to nothing; each row's online softmax starts from it (running max the
// sink, sum exp(0) = 1). An empty `sinks` buffer means none.
//
// Chunked local attention (Llama 4, `attention_chunk` > 0): a row at position p sees only the
// keys of its own chunk, from (p / attention_chunk) * attention_chunk: one more lower bound on the
// visible positions beside the sliding window's.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "attention_blocks.h"
#include "dense_f32_block.h"
#include "fast_math.h"
#include "kv_values.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using vllm_xla::ExpNonPositive;
using vllm_xla::Load;
#if defined(__AVX512F__)
using vllm_xla::Avx512;
#elif defined(VLLM_XLA_AVX2_DECODE)
using vllm_xla::Avx2;
#endif

constexpr float kMaskValue = -1e30f;
constexpr int64_t kRowsPerItem = 16;
constexpr int64_t kItemsPerThread = 4;  // whole-page items when there are at least this many a thread
constexpr int64_t kMaxHeadDim = 1024;
// How far ahead in a sequence's block table an item prefetches (measured on 64 decode rows of
// 208-512 tokens: 2 pages ahead beat 1 and 3).
constexpr int64_t kPrefetchPages = 2;

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

// The first position a row at `position` sees: its sliding window's and its chunk's bounds.
inline int64_t FirstVisible(const Params& prm, int64_t position) {
  int64_t lo = prm.sliding_window > 0 ? std::max<int64_t>(0, position - prm.sliding_window + 1) : 0;
  if (prm.attention_chunk > 0) lo = std::max<int64_t>(lo, position / prm.attention_chunk * prm.attention_chunk);
  return lo;
}

struct Item {
  int32_t seq, first_head, end_head, first_row, end_row;  // kv heads [first_head, end_head)
};

// Per-item scratch: the online-softmax state of a block of `rows` rows of `heads` kv heads (q
// scaled, kept head by head: [heads, rows, G, D]) and one page's scores ([rows, G, S16] for a
// kv head; S16 is S rounded up to 16). Blocks of several rows also keep the current page in
// float32: keys in 16-key panels `[S16 / 16, D, 16]`, values `[S, D]`.
struct Scratch {
  std::vector<float> q, acc, m, denom, scores, keys, values;
  Scratch(int64_t rows, int64_t heads, int64_t G, int64_t S, int64_t D)
      : q(rows * heads * G * D), acc(rows * heads * G * D, 0.0f), m(rows * heads * G, kMaskValue),
        denom(rows * heads * G, 0.0f), scores(rows * G * ((S + 15) / 16 * 16)),
        keys(rows > 1 ? (S + 15) / 16 * 16 * D : 0, 0.0f), values(rows > 1 ? S * D : 0, 0.0f) {}
};

// kD > 0 fixes the head dim at compile time (the common sizes), so the loops over it unroll and
// vectorize; 0 reads it at run time.
template <typename T, int kD>
struct Problem {
  Shapes s;
  Params prm;
  const void* q;  // [T, H, D] float32, or bfloat16 bits when bf16_rows
  const T* cache;
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  const float* sinks;  // [H], or nullptr: none
  void* out;  // same type as q
  bool bf16_rows;
  bool bf16_dots;  // decode scores of bfloat16 rows against a bfloat16 cache with VDPBF16PS

  int64_t HeadDim() const { return kD > 0 ? kD : s.head_dim; }
  float QueryValue(int64_t i) const {
    return bf16_rows ? Load(static_cast<const uint16_t*>(q), i) : static_cast<const float*>(q)[i];
  }
  void StoreOutput(int64_t i, float x) const {
    if (bf16_rows) {
      static_cast<uint16_t*>(out)[i] = vllm_xla::FloatToBf16Bits(x);
    } else {
      static_cast<float*>(out)[i] = x;
    }
  }
  static void Begin() {}
  static void End() {}

  // Online-softmax update of one row's G query heads (q, acc: [G, D]; m, denom: [G]) with keys
  // j0..j1 of one page; each key and value is converted once for all G heads.
  // `q_bits`: the G heads' unscaled bfloat16 query when `bf16_dots`, else unused.
  void Update(const float* q_row, const uint16_t* q_bits, const T* k_page, const T* v_page, float* acc, float* m,
              float* denom, int64_t j0, int64_t j1, int64_t G, float* sc) const {
#if defined(__AVX512F__)
    if constexpr (kD > 0 && kD % 16 == 0) {
      if (s.page_size % 16 == 0) {
        UpdateDecode(q_row, q_bits, k_page, v_page, acc, m, denom, j0, j1, G, sc);
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
  // key widened once for all heads.
  template <class V>
  void ScoreByKey(const float* q_row, const T* k_page, int64_t j0, int64_t j1, int64_t G, float* sc) const {
    constexpr int kW = V::kLanes, kC = kD / kW;
    const int64_t S = s.page_size;
    for (int64_t j = j0; j < j1; ++j) {
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
                    float* m, float* denom, int64_t j0, int64_t j1, int64_t G, float* sc) const {
    const int64_t S = s.page_size;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
      vllm_xla::DecodeScores<kD>(q_row, q_bits, prm.sm_scale, k_page, j0, j1, G, sc, S);
      if (prm.soft_cap > 0.0f) {
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t j = j0; j < j1; ++j) sc[g * S + j] = prm.soft_cap * std::tanh(sc[g * S + j] / prm.soft_cap);
        }
      }
    } else {
      ScoreByKey<Avx512>(q_row, k_page, j0, j1, G, sc);
    }
    Rescale(acc, m, denom, j0, j1, G, sc, S);
    AccumulateHeads(sc, S, v_page, j0, j1, G, acc);
  }
#endif

  // acc[g * D + d] += sum over keys j0..j1 of p[g * stride + j] * values[j * D + d] for G heads;
  // with AVX-512 in blocks of heads that share each value row (`values`: float32, or a page as
  // stored, whose rows are widened once a block).
  template <typename U>
  void AccumulateHeads(const float* p, int64_t stride, const U* values, int64_t j0, int64_t j1, int64_t G,
                       float* acc) const {
    const int64_t D = HeadDim();
    int64_t g = 0;
#if defined(__AVX512F__)
    // Heads in threes, else pairs, while their accumulators and a value row fit in 32 registers.
    if constexpr (kD > 0 && kD % 16 == 0 && kD <= 64) {
      for (; g + 3 <= G; g += 3) vllm_xla::AccumulateValueHeads<3, kD>(p + g * stride, stride, values, j0, j1, acc + g * D);
    }
    if constexpr (kD > 0 && kD % 16 == 0 && kD <= 128) {
      for (; g + 2 <= G; g += 2) vllm_xla::AccumulateValueHeads<2, kD>(p + g * stride, stride, values, j0, j1, acc + g * D);
    }
    if constexpr (kD > 0 && kD % 16 == 0) {
      for (; g < G; ++g) vllm_xla::AccumulateValueHeads<1, kD>(p + g * stride, stride, values, j0, j1, acc + g * D);
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
      const float page_max = vllm_xla::MaxOf(scg, j0, j1, kMaskValue);
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
        for (int64_t j = 0; j < n; j += 16) vllm_xla::KeyPanel16<kD>(k_page + j * kD, keys + j * kD);
        if constexpr (kCopyValues) {
          for (int64_t i = 0; i < n * kD; i += 16) _mm512_storeu_ps(values + i, vllm_xla::Load16(v_page + i));
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
      for (int64_t i = 0; i < count; i += vllm_xla::kF32BlockRows) {
        const int block = static_cast<int>(std::min<int64_t>(vllm_xla::kF32BlockRows, count - i));
        vllm_xla::F32BlockFor(block)(q_vectors + i * D, panel, D, sc + i * S16 + j16, S16);
      }
#else
      int64_t i = 0;
#if defined(__AVX512F__)
      constexpr int kBlock = vllm_xla::kScoreBlock;
      for (; i + kBlock <= count; i += kBlock) vllm_xla::ScoreBlock(q_vectors + i * D, D, panel, sc + i * S16 + j16, S16);
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

  // Rows first_row..end_row of one sequence, for kv heads first_head..end_head. A single row
  // (decode) reads each page once as stored; a block of rows converts each page once and scores
  // all its rows' query heads against it in one pass (several times faster for prefill chunks
  // than scoring a row at a time). The heads of a page
  // lie side by side: an item reads them in one stream.
  void Run(const Item& item) const {
    const int64_t D = HeadDim(), S = s.page_size, G = s.num_heads / s.num_kv_heads;
    const int64_t K = s.num_kv_heads, heads = item.end_head - item.first_head;
    const int64_t rows = item.end_row - item.first_row;
    const int64_t seq_end = cu_q_lens[item.seq + 1];
    const int64_t kv_len = kv_lens[item.seq];
    const int64_t last = kv_len - (seq_end - (item.end_row - 1));  // furthest position
    if (last < 0) return;  // inconsistent input: leave the zeros
    const int64_t first = std::max<int64_t>(0, kv_len - (seq_end - item.first_row));
    const int64_t lo_block = FirstVisible(prm, first);
    // Softmax state of (row r, head h) at r * heads + h; q of (head h, row r) at h * rows + r.
    Scratch w(rows, heads, G, S, D);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t q_row = ((item.first_row + r) * s.num_heads + item.first_head * G) * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* q_scaled = w.q.data() + (h * rows + r) * G * D;
        for (int64_t i = 0; i < G * D; ++i) q_scaled[i] = QueryValue(q_row + h * G * D + i) * prm.sm_scale;
      }
    }
    if (sinks != nullptr) {  // every row's softmax starts with its head's sink column
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < heads * G; ++g) {
          w.m[r * heads * G + g] = sinks[item.first_head * G + g];
          w.denom[r * heads * G + g] = 1.0f;
        }
      }
    }
    const int64_t S16 = PaddedPageSize();
    const int32_t* table = page_indices + item.seq * s.pages_per_seq;
    for (int64_t slot = lo_block / S; slot <= last / S && slot < s.pages_per_seq; ++slot) {
      const int64_t page = std::clamp<int64_t>(table[slot], 0, s.num_pages - 1);
      const int64_t n = std::min<int64_t>(S, last - slot * S + 1);
      const T* page_base = cache + page * 2 * K * S * D;
      const int64_t ahead = slot + kPrefetchPages;
      const bool has_next = ahead <= last / S && ahead < s.pages_per_seq;
      const T* next_base =
          cache + std::clamp<int64_t>(has_next ? table[ahead] : page, 0, s.num_pages - 1) * 2 * K * S * D;
      for (int64_t h = 0; h < heads; ++h) {
        const T* k_page = page_base + (item.first_head + h) * S * D;
        const T* v_page = page_base + (K + item.first_head + h) * S * D;
        if (has_next) {
          // Start loading this head's part of a later page: pages are scattered, so the
          // hardware prefetcher cannot guess it. A head at a time keeps the requests in flight
          // within what the core can track.
          const char* next_k = reinterpret_cast<const char*>(next_base + (item.first_head + h) * S * D);
          const char* next_v = reinterpret_cast<const char*>(next_base + (K + item.first_head + h) * S * D);
          for (int64_t b = 0; b < S * D * static_cast<int64_t>(sizeof(T)); b += 64) {
            __builtin_prefetch(next_k + b);
            __builtin_prefetch(next_v + b);
          }
        }
        const float* q_head = w.q.data() + h * rows * G * D;
        if (rows > 1) {  // every row's scores against the page at once (rows that do not see it: unused)
          ConvertPage(k_page, v_page, n, w.keys.data(), w.values.data());
          ScoreConverted(q_head, rows * G, w.keys.data(), n, w.scores.data());
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t position = kv_len - (seq_end - (item.first_row + r));
          const int64_t lo = FirstVisible(prm, position);
          const int64_t j0 = std::max<int64_t>(lo - slot * S, 0);
          const int64_t j1 = std::min<int64_t>(position - slot * S + 1, n);
          if (position < 0 || j1 <= j0) continue;
          const int64_t i = r * heads + h;
          float* acc = w.acc.data() + i * G * D;
          float* m = w.m.data() + i * G;
          float* denom = w.denom.data() + i * G;
          if (rows > 1) {
            const float* values = std::is_same_v<T, float> ? reinterpret_cast<const float*>(v_page) : w.values.data();
            UpdateScored(values, acc, m, denom, j0, j1, G, w.scores.data() + r * G * S16);
          } else {
            const uint16_t* q_bits =
                bf16_dots ? static_cast<const uint16_t*>(q) + (item.first_row * s.num_heads + (item.first_head + h) * G) * D
                          : nullptr;
            Update(q_head, q_bits, k_page, v_page, acc, m, denom, j0, j1, G, w.scores.data());
          }
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t out_row = ((item.first_row + r) * s.num_heads + item.first_head * G) * D;
      for (int64_t g = 0; g < heads * G; ++g) {
        const int64_t i = r * heads * G + g;
        const float inv = w.denom[i] > 0.0f ? 1.0f / w.denom[i] : 0.0f;
        for (int64_t d = 0; d < D; ++d) StoreOutput(out_row + g * D + d, w.acc[i * D + d] * inv);
      }
    }
  }
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                     ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                     ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out, float sm_scale, int32_t sliding_window,
                     float soft_cap, int32_t attention_chunk, int32_t cache_format) {
  const auto qd = q.dimensions();
  const auto cd = kv_cache.dimensions();
  const auto pd = page_indices.dimensions();
  if (qd.size() != 3 || cd.size() != 3 || pd.size() != 2) {
    return ffi::Error::InvalidArgument("expected q [T, H, D], kv_cache [pages, 2K, S*D], page_indices [R, P]");
  }
  Shapes s{qd[0], qd[1], qd[2], cd[1] / 2, cd[0], cd[2] / qd[2], pd[0], pd[1]};
  if (s.num_heads % s.num_kv_heads != 0 || s.num_heads / s.num_kv_heads > 64 ||
      s.head_dim > kMaxHeadDim || s.page_size * s.head_dim != cd[2]) {
    return ffi::Error::InvalidArgument("q heads must be a multiple (at most 64x) of kv heads, head_dim at most 1024, and the cache rows page_size * head_dim");
  }
  if (sinks.element_count() != 0 && sinks.element_count() != s.num_heads) {
    return ffi::Error::InvalidArgument("sinks must be empty or hold one float32 a query head");
  }
  const float* sink_logits = sinks.element_count() != 0 ? sinks.typed_data() : nullptr;
  const bool bf16_rows = q.element_type() == ffi::DataType::BF16;
  if ((!bf16_rows && q.element_type() != ffi::DataType::F32) || out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("q and the output must both be float32 or both bfloat16");
  }
  std::memset(out->untyped_data(), 0, out->size_bytes());
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t used = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, s.num_slots);
  // An item takes all kv heads of its rows (one stream through each page) when there are enough
  // items to keep every thread busy, else one head each.
  int64_t row_blocks = 0;
  for (int32_t seq = 0; seq < used; ++seq) {
    const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(cu[seq + 1], s.num_tokens) - std::max(cu[seq], 0));
    row_blocks += (rows + kRowsPerItem - 1) / kRowsPerItem;
  }
  const int64_t workers = vllm_xla::Workers(pool, s.num_tokens);
  const int32_t heads_per_item =
      row_blocks >= kItemsPerThread * workers ? static_cast<int32_t>(s.num_kv_heads) : 1;
  auto work = std::make_shared<vllm_xla::SharedWork<Item>>();
  for (int32_t seq = 0; seq < used; ++seq) {
    const int32_t begin = std::max(cu[seq], 0);
    const int32_t end = std::min<int64_t>(cu[seq + 1], s.num_tokens);
    for (int32_t first = begin; first < end; first += kRowsPerItem) {
      const int32_t last = std::min<int32_t>(end, first + kRowsPerItem);
      for (int32_t h = 0; h < s.num_kv_heads; h += heads_per_item) {
        work->items.push_back({seq, h, static_cast<int32_t>(h + heads_per_item), first, last});
      }
    }
  }
  if (work->items.empty()) return ffi::Error::Success();
  Params prm{sm_scale, sliding_window, soft_cap, attention_chunk};
  const int32_t* lens = kv_lens.typed_data();
#if defined(__AVX512F__)
  static const bool bf16_dots_usable = vllm_xla::Avx512Bf16Usable();  // a cpuid query: once
#else
  constexpr bool bf16_dots_usable = false;
#endif
  const int32_t* table = page_indices.typed_data();
  auto run = [&](auto tag, auto dim) {
    using T = decltype(tag);
    Problem<T, decltype(dim)::value> p{s,     prm,   q.untyped_data(), static_cast<const T*>(kv_cache.untyped_data()),
                                       lens,  table, cu,               sink_logits,
                                       out->untyped_data(), bf16_rows,
                                       bf16_rows && std::is_same_v<T, uint16_t> && bf16_dots_usable};
    vllm_xla::RunAll(p, work, pool, workers);
  };
  auto run_dims = [&](auto tag) {
    if (s.head_dim == 64) return run(tag, std::integral_constant<int, 64>());
    if (s.head_dim == 128) return run(tag, std::integral_constant<int, 128>());
    if (s.head_dim == 256) return run(tag, std::integral_constant<int, 256>());
    return run(tag, std::integral_constant<int, 0>());
  };
  if (!vllm_xla::WithCacheType(cache_format, kv_cache.element_type(), run_dims)) {
    return ffi::Error::InvalidArgument(vllm_xla::kCacheTypeError);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaRaggedPagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("attention_chunk")
                                  .Attr<int32_t>("cache_format"));
