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
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileDepth = 32;  // bfloat16 values in a 64-byte tile row
constexpr int64_t kTileCols = 16;   // float32 results in a 64-byte tile row
constexpr int64_t kPrefetchDepth = 4 * kTileDepth;  // how far ahead a panel's weights are fetched

// The `isa` attribute: which path runs (the codes of `DENSE_ISAS` in build.py).
enum DenseIsa : int32_t { kBestIsa = 0, kAvx512Bf16 = 1, kAmx = 2, kAvx2 = 3 };

#if defined(__x86_64__)
#define VLLM_XLA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

using vllm_xla::Avx2Usable;

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

unsigned CpuidLeaf7(unsigned subleaf, int reg) {
  unsigned r[4];
  __asm__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(7), "c"(subleaf));
  return r[reg];
}

// Whether this CPU has AMX tiles with bfloat16 and the kernel lets this process use them.
bool AmxUsable() {
  const unsigned edx = CpuidLeaf7(0, 3);
  const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
  if (!tile || !bf16) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Stores accumulator tile `tile` (a literal: tile registers are named in the instruction) at rows
// [row, row + 16) of column block `block`, through a scratch tile when some rows lie past M.
#define VLLM_XLA_STORE_TILE(tile, row, block)                        \
  do {                                                               \
    if ((row) + kTileRows <= M) {                                    \
      _tile_stored(tile, Out(row, block), N * sizeof(float));        \
    } else {                                                         \
      alignas(64) float scratch[kTileRows * kTileCols];              \
      _tile_stored(tile, scratch, kTileCols * sizeof(float));        \
      CopyValidRows(scratch, row, block);                            \
    }                                                                \
  } while (0)

// Tiles 0-3 accumulate C[row block r][column block c] at 2r + c; 4-5 hold x's row blocks and
// 6-7 the weight's column blocks. Every tile is 16 rows of 64 bytes.
struct AmxProblem {
  const uint16_t* x;  // [Mp, K]: M rows padded to a multiple of 16
  const uint16_t* w;  // [N/16, K/2, 16, 2]
  float* y;           // [M, N]
  int64_t M, Mp, K, N;

  VLLM_XLA_AMX static void Begin() {
    TileConfig config;
    std::memset(&config, 0, sizeof(config));
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = kTileRows;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
  }
  VLLM_XLA_AMX static void End() { _tile_release(); }

  VLLM_XLA_AMX void Run(const Item& item) const {
    // Row blocks outer: a panel's weights come from memory on the first pass and from cache
    // after it, and each pass writes along the output's rows.
    for (int64_t row = 0; row < Mp; row += 2 * kTileRows) {
      const bool two_rows = row + kTileRows < Mp;
      const uint16_t* a0 = x + row * K;
      const uint16_t* a1 = a0 + kTileRows * K;
      for (int64_t block = item.first_block; block < item.end_block; block += 2) {
        const bool two_cols = block + 1 < item.end_block;
        const uint16_t* b0 = w + block * (K / 2) * 32;
        const uint16_t* b1 = b0 + (K / 2) * 32;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += kTileDepth) {
          if (row == 0) {  // the first pass streams the weights from memory: fetch ahead
            Prefetch(b0 + (k + kPrefetchDepth) * 16);
            if (two_cols) Prefetch(b1 + (k + kPrefetchDepth) * 16);
          }
          _tile_loadd(6, b0 + k * 16, 64);
          _tile_loadd(4, a0 + k, K * 2);
          _tile_dpbf16ps(0, 4, 6);
          if (two_cols) {
            _tile_loadd(7, b1 + k * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_rows) {
            _tile_loadd(5, a1 + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two_cols) _tile_dpbf16ps(3, 5, 7);
          }
        }
        VLLM_XLA_STORE_TILE(0, row, block);
        if (two_cols) VLLM_XLA_STORE_TILE(1, row, block + 1);
        if (two_rows) {
          VLLM_XLA_STORE_TILE(2, row + kTileRows, block);
          if (two_cols) VLLM_XLA_STORE_TILE(3, row + kTileRows, block + 1);
        }
      }
    }
  }

  // Requests the 1 KiB tile at `tile` into the cache (the address may lie past the weight's end:
  // prefetches never fault).
  static void Prefetch(const uint16_t* tile) {
    const char* bytes = reinterpret_cast<const char*>(tile);
    for (int line = 0; line < 16; ++line) _mm_prefetch(bytes + 64 * line, _MM_HINT_T0);
  }

  float* Out(int64_t row, int64_t block) const { return y + row * N + block * kTileCols; }

  // The rows of a 16-row result tile (stored in `tile`) that lie below M.
  void CopyValidRows(const float* tile, int64_t row, int64_t block) const {
    for (int64_t r = 0; row + r < M; ++r) {
      std::memcpy(Out(row + r, block), tile + r * kTileCols, kTileCols * sizeof(float));
    }
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
  static const bool amx = AmxUsable(), vector = vllm_xla::Avx512Bf16Usable(), avx2 = Avx2Usable();
  return (isa == kAmx && amx) || (isa == kAvx512Bf16 && vector) || (isa == kAvx2 && avx2);
}

void RunAmx(const uint16_t* x_bits, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
            ffi::ThreadPool& pool) {
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  std::vector<uint16_t> padded;
  if (Mp != M) {
    padded.assign(Mp * K, 0);
    std::memcpy(padded.data(), x_bits, M * K * sizeof(uint16_t));
    x_bits = padded.data();
  }
  const int64_t cached_blocks = vllm_xla::CachedBlocks(K, sizeof(uint16_t));
  RunOverColumnBlocks(AmxProblem{x_bits, w, y, M, Mp, K, N}, N / kTileCols, cached_blocks, pool);
}

void RunVector(const uint16_t* x_bits, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
               ffi::ThreadPool& pool) {
  const int64_t cached_blocks = vllm_xla::CachedBlocks(K, sizeof(uint16_t));
  RunOverColumnBlocks(VectorProblem{{x_bits, w, y, M, K, N}}, N / kTileCols,
                      std::max<int64_t>(kVectorBlocks, cached_blocks), pool);
}

ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                 ffi::ResultBuffer<ffi::F32> y, int32_t isa, int32_t layer) {
  const auto xd = x.dimensions();
  const auto weight = vllm_xla::LayerOf(w.dimensions(), w.dimensions().size() == 5, layer);
  const auto wd = weight.dims;
  if (!weight.ok || xd.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 2 || wd[1] * 2 != xd[1] ||
      xd[1] % kTileDepth != 0) {
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
