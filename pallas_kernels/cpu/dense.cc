// SPDX-License-Identifier: Apache-2.0
// bfloat16 dense layers on Intel AMX as an XLA FFI handler: y[M, N] (float32) = x[M, K] @ w.
// Compiled on every CPU (the AMX functions carry their own target attribute); it runs only where
// `VllmXlaAmxUsable` says so.
//
// XLA:CPU runs bfloat16 dots without AMX; this kernel multiplies 16x32 tiles of x by weight
// tiles with TDPBF16PS, accumulating in float32. The weight comes packed once at load time as
// [N/16, K/2, 16, 2] (`pack_dense_kernel` in dense.py): each 16-column, 32-deep tile is 1 KiB of
// contiguous memory, in the pair-interleaved layout TDPBF16PS reads, and a column panel streams
// from memory in order. K must be a multiple of 32 and N of 16.
//
// Work items are runs of 16-column blocks (two per thread), walked 32 rows by 32 columns; the
// first row pass streams the weights from memory with prefetching, later ones find them cached.

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

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileDepth = 32;  // bfloat16 values in a 64-byte tile row
constexpr int64_t kTileCols = 16;   // float32 results in a 64-byte tile row
constexpr int64_t kItemsPerThread = 2;  // fewer, longer weight streams; enough to rebalance
constexpr int64_t kItemWeightBytes = 512 << 10;
constexpr int64_t kPrefetchDepth = 4 * kTileDepth;  // how far ahead a panel's weights are fetched

#if defined(__x86_64__)
#define VLLM_XLA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether this CPU has AMX tiles with bfloat16 and the kernel lets this process use them.
bool AmxUsable() {
  unsigned eax, ebx, ecx, edx;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
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

struct Item {
  int64_t first_block, end_block;  // 16-column blocks
};

// Tiles 0-3 accumulate C[row block r][column block c] at 2r + c; 4-5 hold x's row blocks and
// 6-7 the weight's column blocks. Every tile is 16 rows of 64 bytes.
struct Problem {
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

ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                 ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != 16 || wd[3] != 2 || wd[1] * 2 != xd[1] ||
      xd[1] % kTileDepth != 0) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K] and a packed weight [N/16, K/2, 16, 2] with K a multiple of 32");
  }
  static const bool amx_usable = AmxUsable();  // probed once a process
  if (!amx_usable) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "this CPU or kernel does not allow AMX bfloat16");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0] * 16, Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  if (M == 0) return ffi::Error::Success();
  const auto* x_bits = reinterpret_cast<const uint16_t*>(x.untyped_data());
  std::vector<uint16_t> padded;
  if (Mp != M) {
    padded.assign(Mp * K, 0);
    std::memcpy(padded.data(), x_bits, M * K * sizeof(uint16_t));
    x_bits = padded.data();
  }
  const int64_t blocks = N / kTileCols;
  const int64_t threads = pool.num_threads() + 1;
  // Two items a thread, each an even number of blocks (but the last) and at most an L2's share
  // of weights: later row passes reread them.
  const int64_t cached_blocks = kItemWeightBytes / (K * kTileCols * sizeof(uint16_t));
  const int64_t per_item =
      std::max<int64_t>(2, std::min(blocks / (kItemsPerThread * threads), cached_blocks) / 2 * 2);
  auto work = std::make_shared<vllm_xla::SharedWork<Item>>();
  for (int64_t first = 0; first < blocks; first += per_item) {
    work->items.push_back({first, std::min(blocks, first + per_item)});
  }
  Problem problem{x_bits, reinterpret_cast<const uint16_t*>(w.untyped_data()), y->typed_data(), M, Mp, K, N};
  vllm_xla::RunAll(problem, work, pool);
  return ffi::Error::Success();
}

#else  // not x86-64: no AMX

bool AmxUsable() { return false; }

ffi::Error Dense(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "AMX dense layers need an x86-64 CPU");
}

#endif

}  // namespace

// 1 when this process may run the AMX dense kernel, else 0 (probed once from Python).
extern "C" int VllmXlaAmxUsable() { return AmxUsable() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaAmxDense, Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
