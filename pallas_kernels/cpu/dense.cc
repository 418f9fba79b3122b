// SPDX-License-Identifier: Apache-2.0
// bfloat16 dense layers as an XLA FFI handler: y[M, N] (float32) = x[M, K] @ w, on Intel AMX tiles
// or, on CPUs without AMX that have AVX-512 BF16 (AMD Zen 4 and later, Intel Cooper Lake), with
// VDPBF16PS on vectors, or else with AVX2 FMA in float32 (every x86-64 CPU of the last decade;
// dense_avx2.h). Compiled on every CPU (each path carries its own target attribute); a path runs
// only where `IsaUsable` finds it.
//
// XLA:CPU runs bfloat16 dots without either instruction, and streams a single row's weights at a
// few GB/s. Both paths read one packed weight layout, made once at load time: [N/16, K/2, 16, 2]
// (`pack_dense_kernel` in dense.py). Each 16-column, 32-deep tile is 1 KiB of contiguous memory in
// the pair-interleaved layout TDPBF16PS reads, and each 64-byte row of it is the vector operand
// VDPBF16PS takes against one broadcast pair of x; a column panel streams from memory in order.
// K must be a multiple of 32 and N of 16.
//
// Work items are runs of 16-column blocks (two per thread). AMX walks an item 32 rows by 32
// columns; the vector path walks it in register blocks of up to 6 rows by 64 columns. In both the
// first row pass streams the weights from memory, later ones find them cached.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "dense_amx.h"
#include "dense_blocks.h"
#include "dense_avx2.h"
#include "dense_avx512_bf16.h"
#include "layer_stack.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using vllm_xla::Item;
using vllm_xla::RunOverColumnBlocks;
using vllm_xla::WalkRegisterBlocks;

constexpr int64_t kBlockCols = 16;  // columns of one packed panel

// The `isa` attribute: which path runs (the codes of `DENSE_ISAS` in build.py).
enum DenseIsa : int32_t { kBestIsa = 0, kAvx512Bf16 = 1, kAmx = 2, kAvx2 = 3 };

#if defined(__x86_64__)

using vllm_xla::Avx2Usable;

// The AMX product over a work item's panels, read in place from the packed weight.
struct AmxProblem : vllm_xla::AmxProduct {
  const uint16_t* w;  // [N/16, K/2, 16, 2]

  static void Begin() { vllm_xla::AmxBegin(); }
  static void End() { vllm_xla::AmxEnd(); }
  void Run(const Item& item) const {
    const uint16_t* panels = w + item.first_block * K * vllm_xla::kAmxTileCols;
    Multiply(panels, item.first_block, item.end_block, /*from_memory=*/true);
  }
};

constexpr int kVectorRows = vllm_xla::kBf16VectorRows;
constexpr int kVectorBlocks = vllm_xla::kBf16VectorBlocks;

// What the vector paths read and write, and their (empty) per-thread set-up for `RunAll`.
struct VectorOperands {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [N/16, K/2, 16, 2]
  float* y;           // [M, N]
  int64_t M, K, N;

  static void Begin() {}
  static void End() {}
};

// The same product with VDPBF16PS (`Bf16VectorBlock` in dense_avx512_bf16.h).
struct VectorProblem : VectorOperands {
  void Run(const Item& item) const {
    const int64_t panel = K * 16;  // uint16 values in one column block
    WalkRegisterBlocks(item, M, K * sizeof(uint16_t), kVectorRows, kVectorBlocks,
                       [&](int64_t row, int rows, int64_t block, int blocks) {
                         vllm_xla::Bf16VectorBlockFor(rows, blocks)(x + row * K, w + block * panel, panel, K,
                                                                    y + row * N + block * 16, N);
                       });
  }
};

// Whether this process may run the `isa` path, probed once.
bool IsaUsable(DenseIsa isa) {
  static const bool amx = vllm_xla::AmxUsable(), vector = vllm_xla::Avx512Bf16Usable(), avx2 = Avx2Usable();
  return (isa == kAmx && amx) || (isa == kAvx512Bf16 && vector) || (isa == kAvx2 && avx2);
}

void RunAmx(const uint16_t* x_bits, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
            ffi::ThreadPool& pool) {
  std::vector<uint16_t> padded;
  int64_t Mp = M;
  const uint16_t* rows = vllm_xla::AmxRows(x_bits, M, K, padded, Mp);
  const int64_t cached_blocks = vllm_xla::CachedBlocks(K, sizeof(uint16_t));
  RunOverColumnBlocks(AmxProblem{{rows, y, M, Mp, K, N}, w}, N / kBlockCols, cached_blocks, pool);
}

void RunVector(const uint16_t* x_bits, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
               ffi::ThreadPool& pool) {
  const int64_t cached_blocks = vllm_xla::CachedBlocks(K, sizeof(uint16_t));
  RunOverColumnBlocks(VectorProblem{{x_bits, w, y, M, K, N}}, N / kBlockCols,
                      std::max<int64_t>(kVectorBlocks, cached_blocks), pool);
}

ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                 ffi::ResultBuffer<ffi::F32> y, int32_t isa, int32_t layer) {
  const auto xd = x.dimensions();
  const auto weight = vllm_xla::LayerOf(w.dimensions(), w.dimensions().size() == 5, layer);
  const auto wd = weight.dims;
  if (!weight.ok || xd.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 2 || wd[1] * 2 != xd[1] ||
      xd[1] % vllm_xla::kAmxTileDepth != 0) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K] and a packed weight [N/16, K/2, 16, 2] (or a stack of them holding `layer`) with K a "
        "multiple of 32");
  }
  DenseIsa run = static_cast<DenseIsa>(isa);
  if (run == kBestIsa) run = IsaUsable(kAmx) ? kAmx : IsaUsable(kAvx512Bf16) ? kAvx512Bf16 : kAvx2;
  if (!IsaUsable(run)) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "this CPU or kernel does not allow the requested dense path (AMX bfloat16, "
                      "AVX-512 BF16 or AVX2 with FMA)");
  }
  const int64_t K = xd[1], N = wd[0] * 16;
  const auto* x_bits = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const int64_t M = vllm_xla::RowsBeforeZeroTail<uint16_t>(x_bits, xd[0], K, 0x7fff);
  std::memset(y->typed_data() + M * N, 0, sizeof(float) * (xd[0] - M) * N);
  if (M == 0) return ffi::Error::Success();
  const auto* w_bits = reinterpret_cast<const uint16_t*>(w.untyped_data()) + weight.offset;
  if (run == kAmx) {
    RunAmx(x_bits, w_bits, y->typed_data(), M, K, N, pool);
  } else if (run == kAvx512Bf16) {
    RunVector(x_bits, w_bits, y->typed_data(), M, K, N, pool);
  } else {
    vllm_xla::RunBf16Avx2(x_bits, w_bits, y->typed_data(), M, K, N, pool);
  }
  return ffi::Error::Success();
}

#else  // not x86-64: neither AMX nor AVX

bool IsaUsable(DenseIsa) { return false; }

ffi::Error Dense(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::F32>,
                 int32_t, int32_t) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "the native dense layers need an x86-64 CPU");
}

#endif

}  // namespace

// The dense paths this process may run, as a bit mask: bit 1 AVX-512 BF16, bit 2 AMX, bit 3 AVX2.
extern "C" int VllmXlaDenseIsas() {
  return (IsaUsable(kAvx512Bf16) ? 1 << kAvx512Bf16 : 0) | (IsaUsable(kAmx) ? 1 << kAmx : 0) |
         (IsaUsable(kAvx2) ? 1 << kAvx2 : 0);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaDense, Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("layer"));
