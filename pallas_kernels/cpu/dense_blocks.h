// SPDX-License-Identifier: Apache-2.0
// The walk the dense kernels share: work items are runs of 16-column blocks of the weight, run on
// the caller's thread and XLA's pool, each walked in register blocks of rows by column blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace vllm_xla {

constexpr int64_t kItemsPerThread = 2;  // fewer, longer weight streams; enough to rebalance
constexpr int64_t kChunkBytes = 128 << 10;  // x rows a vector item walks before its next columns
constexpr int64_t kItemWeightBytes = 512 << 10;  // weights a work item rereads on later row passes

// The rows of x [M, K] before its trailing rows of zeros (+0 or -0; `magnitude_mask` clears the
// sign bit of a `Bits` value). Such a row's product with any finite weight is a row of zeros, so the
// kernels write those rows as zeros without multiplying: the padding tokens of a step, whose
// hidden states the model keeps at zero (`models.DecoderModel`), cost nothing in the dense layers.
template <typename Bits>
int64_t RowsBeforeZeroTail(const Bits* x, int64_t M, int64_t K, Bits magnitude_mask) {
  for (int64_t row = M - 1; row >= 0; --row) {
    const Bits* values = x + row * K;
    for (int64_t k = 0; k < K; ++k) {
      if (values[k] & magnitude_mask) return row + 1;
    }
  }
  return 0;
}

// How many 16-column blocks of a K-deep weight (of `element_bytes` values) fit an item's share
// of L2: later row passes reread an item's weights, so items are at most that long.
inline int64_t CachedBlocks(int64_t K, int64_t element_bytes) {
  return kItemWeightBytes / (K * 16 * element_bytes);
}

struct Item {
  int64_t first_block, end_block;  // 16-column blocks
};

// Calls `block(row, rows, column_block, blocks)` over a work item in register blocks of up to
// `block_rows` rows by `block_cols` 16-column blocks. Rows go in chunks whose x stays in L2 while
// the item's column blocks pass over them (x of all rows would not: measured with VDPBF16PS at
// 1024 rows, 576x3072 and 1536x576 run 4-9% faster so).
template <typename Block>
void WalkRegisterBlocks(const Item& item, int64_t M, int64_t x_row_bytes, int block_rows, int block_cols,
                        Block&& block) {
  const int64_t chunk_rows = std::max<int64_t>(
      block_rows, kChunkBytes / x_row_bytes / block_rows * block_rows);
  for (int64_t first_row = 0; first_row < M; first_row += chunk_rows) {
    const int64_t end_row = std::min(M, first_row + chunk_rows);
    for (int64_t col = item.first_block; col < item.end_block; col += block_cols) {
      const int cols = static_cast<int>(std::min<int64_t>(block_cols, item.end_block - col));
      for (int64_t row = first_row; row < end_row; row += block_rows) {
        block(row, static_cast<int>(std::min<int64_t>(block_rows, end_row - row)), col, cols);
      }
    }
  }
}

// Runs a problem over runs of 16-column blocks, two a thread, each an even number of blocks (but
// the last) and at most `max_item_blocks` long.
template <typename Problem>
void RunOverColumnBlocks(const Problem& problem, int64_t blocks, int64_t max_item_blocks,
                         xla::ffi::ThreadPool& pool) {
  const int64_t threads = Workers(pool, problem.M);
  const int64_t per_item =
      std::max<int64_t>(2, std::min(blocks / (kItemsPerThread * threads), max_item_blocks) / 2 * 2);
  auto work = std::make_shared<SharedWork<Item>>();
  for (int64_t first = 0; first < blocks; first += per_item) {
    work->items.push_back({first, std::min(blocks, first + per_item)});
  }
  RunAll(problem, work, pool, threads);
}

#if defined(__x86_64__)
// Whether this CPU has AVX2 and FMA (and the operating system saves the AVX state).
inline bool Avx2Usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// Whether this CPU has AVX-512 F (and the operating system saves the AVX-512 state).
inline bool Avx512Usable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
#endif

}  // namespace vllm_xla
