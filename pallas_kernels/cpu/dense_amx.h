// SPDX-License-Identifier: Apache-2.0
// The AMX bfloat16 product the dense kernels share (dense.cc's "amx" path, and dense_int4.cc's for
// many rows, on its panels widened to bfloat16): x[M, K] (bfloat16) @ column panels [K/2, 16, 2]
// (bfloat16 pairs: each 16-column, 32-deep tile is 1 KiB of contiguous memory in the layout
// TDPBF16PS reads) into y[M, N] (float32). K must be a multiple of 32.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace vllm_xla {

constexpr int64_t kAmxTileRows = 16;
constexpr int64_t kAmxTileDepth = 32;  // bfloat16 values in a 64-byte tile row
constexpr int64_t kAmxTileCols = 16;   // float32 results in a 64-byte tile row

}  // namespace vllm_xla

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define VLLM_XLA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))

namespace vllm_xla {

constexpr int64_t kAmxPrefetchDepth = 4 * kAmxTileDepth;  // how far ahead a panel's weights are fetched

// Whether this CPU has AMX tiles with bfloat16 and the kernel lets this process use them.
inline bool AmxUsable() {
  unsigned r[4];
  __asm__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(7), "c"(0));
  const bool tile = r[3] & (1u << 24), bf16 = r[3] & (1u << 22);
  if (!tile || !bf16) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// A thread's tile set-up before its first item (`RunAll`'s `Problem::Begin`) and release after its
// last: eight tiles of 16 rows of 64 bytes.
VLLM_XLA_AMX inline void AmxBegin() {
  struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kAmxTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}
VLLM_XLA_AMX inline void AmxEnd() { _tile_release(); }

// Stores accumulator tile `tile` (a literal: tile registers are named in the instruction) at rows
// [row, row + 16) of column block `block`, through a scratch tile when some rows lie past M.
#define VLLM_XLA_STORE_TILE(tile, row, block)                        \
  do {                                                               \
    if ((row) + kAmxTileRows <= M) {                                 \
      _tile_stored(tile, Out(row, block), N * sizeof(float));        \
    } else {                                                         \
      alignas(64) float scratch[kAmxTileRows * kAmxTileCols];        \
      _tile_stored(tile, scratch, kAmxTileCols * sizeof(float));     \
      CopyValidRows(scratch, row, block);                            \
    }                                                                \
  } while (0)

// Tiles 0-3 accumulate C[row block r][column block c] at 2r + c; 4-5 hold x's row blocks and
// 6-7 the weight's column blocks.
struct AmxProduct {
  const uint16_t* x;  // [Mp, K]: M rows padded to a multiple of 16
  float* y;           // [M, N]
  int64_t M, Mp, K, N;

  // y's column blocks [first_block, end_block) from their panels, the first at `panels` and each
  // K * 16 values after the previous. Row blocks outer: the panels come from memory on the first
  // pass (fetched ahead when `from_memory`) and from cache after it, and each pass writes along
  // the output's rows.
  VLLM_XLA_AMX void Multiply(const uint16_t* panels, int64_t first_block, int64_t end_block,
                             bool from_memory) const {
    for (int64_t row = 0; row < Mp; row += 2 * kAmxTileRows) {
      const bool two_rows = row + kAmxTileRows < Mp;
      const uint16_t* a0 = x + row * K;
      const uint16_t* a1 = a0 + kAmxTileRows * K;
      for (int64_t block = first_block; block < end_block; block += 2) {
        const bool two_cols = block + 1 < end_block;
        const uint16_t* b0 = panels + (block - first_block) * K * kAmxTileCols;
        const uint16_t* b1 = b0 + K * kAmxTileCols;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += kAmxTileDepth) {
          if (row == 0 && from_memory) {
            Prefetch(b0 + (k + kAmxPrefetchDepth) * 16);
            if (two_cols) Prefetch(b1 + (k + kAmxPrefetchDepth) * 16);
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
          VLLM_XLA_STORE_TILE(2, row + kAmxTileRows, block);
          if (two_cols) VLLM_XLA_STORE_TILE(3, row + kAmxTileRows, block + 1);
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

  float* Out(int64_t row, int64_t block) const { return y + row * N + block * kAmxTileCols; }

  // The rows of a 16-row result tile (stored in `tile`) that lie below M.
  void CopyValidRows(const float* tile, int64_t row, int64_t block) const {
    for (int64_t r = 0; row + r < M; ++r) {
      std::memcpy(Out(row + r, block), tile + r * kAmxTileCols, kAmxTileCols * sizeof(float));
    }
  }
};

#undef VLLM_XLA_STORE_TILE

// x [M, K] as AMX reads it: rows padded with zeros to a multiple of 16 (into `padded`, when M is
// not one already). Returns the rows and sets `Mp`.
inline const uint16_t* AmxRows(const uint16_t* x, int64_t M, int64_t K, std::vector<uint16_t>& padded, int64_t& Mp) {
  Mp = (M + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
  if (Mp == M) return x;
  padded.assign(Mp * K, 0);
  std::memcpy(padded.data(), x, M * K * sizeof(uint16_t));
  return padded.data();
}

}  // namespace vllm_xla

#endif  // __x86_64__
