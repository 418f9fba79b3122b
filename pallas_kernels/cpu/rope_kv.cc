// SPDX-License-Identifier: Apache-2.0
// RoPE on a step's fused q/k/v projection and the KV-cache write, as one XLA FFI handler.
//
// Same contract as `pallas_kernels.rope.split_and_rotate` then `write_kv`: the projection `qkv [T, (H + 2K) * D]`
// (float32 or bfloat16) splits into q, k and v heads; q and k rotate by their positions' rows of
// a RoPE table `[P, D]` (cosines, then sines; rotate-half convention); k and v are stored at each
// token's slot of the page-major cache (layout.py), and the rotated q is returned. Values are
// rounded to the output dtype after the projection and after the rotation, as the unfused model
// rounds them. On XLA:CPU the same work ran as loop fusions (the projection's convert, the q and
// k rotations with their table gathers, the cache scatter), several times slower than these calls
// in a decode step of the embedded model (traced).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "kv_values.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using vllm_xla::Load;
using vllm_xla::RoundToBf16;
using vllm_xla::Store;

constexpr int64_t kMaxHeadDim = 1024;

struct Shapes {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim;  // q [T, H, D]; k, v [T, K, D]
  int64_t num_pages, page_size, table_rows;               // cache [pages, 2K, S * D]; table [P, D]
};

// Rounds to the output's precision: bfloat16 (bits in uint16) or, for float32 outputs, none.
template <typename Q>
inline float Round(float x) {
  if constexpr (std::is_same_v<Q, uint16_t>) return RoundToBf16(x);
  return x;
}

// Rotates head `x` ([D], rounded to Q's precision) by `cos`, `sin` ([D / 2]) into `out`, rounded
// again.
template <typename Q>
inline void Rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = Round<Q>(x[i] * cos[i] - x[i + half] * sin[i]);
    out[i + half] = Round<Q>(x[i + half] * cos[i] + x[i] * sin[i]);
  }
}

// One call's buffers: qkv of element type In, q_out of Q, the cache of C (see RunToken).
struct Call {
  Shapes s;
  const void* qkv;
  const int32_t* positions;
  const float* table;
  const int32_t* slots;
  int64_t slot_offset;
  void* q_out;
  void* cache;
};

// One token: its q heads rotated into `q_out` (of element type Q), its k heads rotated and its v
// heads stored into the cache (of element type C) unless its slot is negative or past the cache.
template <typename In, typename Q, typename C>
void RunToken(const Call& c, int64_t t) {
  const Shapes& s = c.s;
  const In* qkv = static_cast<const In*>(c.qkv);
  Q* q_out = static_cast<Q*>(c.q_out);
  const int64_t D = s.head_dim, H = s.num_heads, K = s.num_kv_heads, S = s.page_size;
  const int64_t row_len = (H + 2 * K) * D;
  const int64_t position = std::clamp<int64_t>(c.positions[t], 0, s.table_rows - 1);
  const float* cos = c.table + position * D;
  const float* sin = cos + D / 2;
  float head[kMaxHeadDim], rotated[kMaxHeadDim];
  auto load_head = [&](int64_t h) {
    for (int64_t d = 0; d < D; ++d) head[d] = Round<Q>(Load(qkv + t * row_len + h * D, d));
  };
  for (int64_t h = 0; h < H; ++h) {
    load_head(h);
    Rotate<Q>(head, cos, sin, D, rotated);
    for (int64_t d = 0; d < D; ++d) Store(q_out + (t * H + h) * D, d, rotated[d]);
  }
  const int64_t slot = c.slots[t] < 0 ? -1 : c.slots[t] + c.slot_offset;
  if (slot < 0 || slot >= s.num_pages * S) return;
  C* page = static_cast<C*>(c.cache) + (slot / S) * 2 * K * S * D + (slot % S) * D;
  for (int64_t h = 0; h < K; ++h) {
    load_head(H + h);
    Rotate<Q>(head, cos, sin, D, rotated);
    for (int64_t d = 0; d < D; ++d) Store(page + h * S * D, d, rotated[d]);
    load_head(H + K + h);
    for (int64_t d = 0; d < D; ++d) Store(page + (K + h) * S * D, d, head[d]);
  }
}

// Items of kTokensPerItem tokens for the caller's thread and XLA's pool (parallel.h): the cache
// lines a token writes are scattered (one per head), so two threads keep more misses in flight.
constexpr int64_t kTokensPerItem = 16;

struct Item {
  int64_t first, end;  // tokens [first, end)
};

template <typename In, typename Q, typename C>
struct Problem {
  Call call;

  static void Begin() {}
  static void End() {}
  void Run(const Item& item) const {
    for (int64_t t = item.first; t < item.end; ++t) RunToken<In, Q, C>(call, t);
  }
};

template <typename In, typename Q, typename C>
void RunAll(const Call& c, ffi::ThreadPool& pool) {
  auto work = std::make_shared<vllm_xla::SharedWork<Item>>();
  for (int64_t t = 0; t < c.s.num_tokens; t += kTokensPerItem) {
    work->items.push_back({t, std::min(c.s.num_tokens, t + kTokensPerItem)});
  }
  if (work->items.empty()) return;
  const Problem<In, Q, C> p{c};
  vllm_xla::RunAll(p, work, pool, vllm_xla::Workers(pool, c.s.num_tokens));
}

// Runs the call for the cache's element type (`vllm_xla::WithCacheType`); false if none fits.
template <typename In, typename Q>
bool RunForCache(int32_t cache_format, ffi::DataType type, const Call& c, ffi::ThreadPool& pool) {
  return vllm_xla::WithCacheType(cache_format, type, [&](auto tag) { RunAll<In, Q, decltype(tag)>(c, pool); });
}

ffi::Error RopeWriteKv(ffi::ThreadPool pool, ffi::AnyBuffer qkv, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> table,
                       ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> q,
                       ffi::Result<ffi::AnyBuffer> cache_out, int32_t num_kv_heads, int64_t slot_offset,
                       int32_t cache_format) {
  const auto qd = q->dimensions();
  const auto cd = kv_cache.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 3 || cd.size() != 3 || td.size() != 2 || qkv.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("expected qkv [T, (H + 2K) * D], table [P, D], kv_cache [pages, 2K, S*D]");
  }
  Shapes s{qd[0], qd[1], num_kv_heads, qd[2], cd[0], cd[2] / qd[2], td[0]};
  if (s.head_dim > kMaxHeadDim || s.head_dim % 2 != 0 || td[1] != s.head_dim || cd[1] != 2 * s.num_kv_heads ||
      s.page_size * s.head_dim != cd[2] || qkv.dimensions()[1] != (s.num_heads + 2 * s.num_kv_heads) * s.head_dim ||
      qkv.dimensions()[0] != s.num_tokens || s.table_rows < 1) {
    return ffi::Error::InvalidArgument("qkv, table and kv_cache shapes do not match q [T, H, D] and num_kv_heads");
  }
  if (cache_out->untyped_data() != kv_cache.untyped_data()) {  // XLA aliases them; copy if it did not
    std::memcpy(cache_out->untyped_data(), kv_cache.untyped_data(), kv_cache.size_bytes());
  }
  const ffi::DataType in = qkv.element_type(), out = q->element_type(), type = kv_cache.element_type();
  const Call c{s,           qkv.untyped_data(), positions.typed_data(), table.typed_data(), slot_mapping.typed_data(),
               slot_offset, q->untyped_data(),  cache_out->untyped_data()};
  bool ran = false;
  if (in == ffi::DataType::F32 && out == ffi::DataType::F32) {
    ran = RunForCache<float, float>(cache_format, type, c, pool);
  } else if (in == ffi::DataType::F32 && out == ffi::DataType::BF16) {
    ran = RunForCache<float, uint16_t>(cache_format, type, c, pool);
  } else if (in == ffi::DataType::BF16 && out == ffi::DataType::BF16) {
    ran = RunForCache<uint16_t, uint16_t>(cache_format, type, c, pool);
  } else {
    return ffi::Error::InvalidArgument("qkv must be float32 or bfloat16, q float32 (from float32 qkv) or bfloat16");
  }
  if (!ran) {
    return ffi::Error::InvalidArgument(vllm_xla::kCacheTypeError);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaRopeWriteKv, RopeWriteKv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("num_kv_heads")
                                  .Attr<int64_t>("slot_offset")
                                  .Attr<int32_t>("cache_format"));
