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

#include "attention_page.h"
#include "kv_values.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using vllm_xla::kMaskValue;
using vllm_xla::kMaxHeadDim;
using vllm_xla::Load;
using vllm_xla::Params;
using vllm_xla::Shapes;

constexpr int64_t kRowsPerItem = 16;
constexpr int64_t kItemsPerThread = 4;  // whole-page items when there are at least this many a thread
// How far ahead in a sequence's block table a block of rows (prefill) prefetches: 2 pages.
constexpr int64_t kPrefetchPages = 2;

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

// One attention call: its buffers and the walk of an item's pages (the page math: `PageUpdate`).
template <typename T, int kD>
struct Problem : vllm_xla::PageUpdate<T, kD> {
  using Base = vllm_xla::PageUpdate<T, kD>;
  using Base::ConvertPage, Base::HeadDim, Base::PaddedPageSize, Base::prm, Base::s, Base::ScoreConverted,
      Base::Update, Base::UpdateScored;

  const void* q;  // [T, H, D] float32, or bfloat16 bits when bf16_rows
  const T* cache;
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  const float* sinks;  // [H], or nullptr: none
  void* out;  // same type as q
  bool bf16_rows;
  bool bf16_dots;  // decode scores of bfloat16 rows against a bfloat16 cache with VDPBF16PS

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
  // The page at `slot` of a sequence's block table (an index outside the cache clamped into it).
  const T* PageAt(const int32_t* table, int64_t slot) const {
    const int64_t page = std::clamp<int64_t>(table[slot], 0, s.num_pages - 1);
    return cache + page * 2 * s.num_kv_heads * s.page_size * HeadDim();
  }
  // The page `ahead` slots after `slot`, or none past the sequence's `last` position.
  const T* PageAfter(const int32_t* table, int64_t slot, int64_t last, int64_t ahead) const {
    const int64_t next = slot + ahead;
    return next > last / s.page_size || next >= s.pages_per_seq ? nullptr : PageAt(table, next);
  }

  static void Begin() {}
  static void End() {}

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
      const int64_t n = std::min<int64_t>(S, last - slot * S + 1);
      const T* page_base = PageAt(table, slot);
      // Pages are scattered, so the hardware prefetcher cannot guess the next one: a block of rows
      // loads a later page's part for each head in one burst as it starts the head (its scoring
      // takes long enough); a single row's update loads the part the walk reads next, a few lines
      // with each key (`Update`: a burst there fills the core's miss queue and stalls the loads).
      const T* next_page = PageAfter(table, slot, last, 1);
      const T* prefetched_page = rows > 1 ? PageAfter(table, slot, last, kPrefetchPages) : nullptr;
      for (int64_t h = 0; h < heads; ++h) {
        const T* k_page = page_base + (item.first_head + h) * S * D;
        const T* v_page = page_base + (K + item.first_head + h) * S * D;
        if (prefetched_page != nullptr) {
          const char* next_k = reinterpret_cast<const char*>(prefetched_page + (item.first_head + h) * S * D);
          const char* next_v = reinterpret_cast<const char*>(prefetched_page + (K + item.first_head + h) * S * D);
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
            // What the walk reads after this head's values: the next head's keys, else the next page's.
            const T* after_values =
                h + 1 < heads ? k_page + S * D : next_page == nullptr ? nullptr : next_page + item.first_head * S * D;
            Update(q_head, q_bits, k_page, v_page, acc, m, denom, j0, j1, G, w.scores.data(), v_page, after_values);
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
    Problem<T, decltype(dim)::value> p{{s, prm}, q.untyped_data(), static_cast<const T*>(kv_cache.untyped_data()),
                                       lens,     table,            cu,
                                       sink_logits, out->untyped_data(), bf16_rows,
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
