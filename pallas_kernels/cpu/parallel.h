// SPDX-License-Identifier: Apache-2.0
// Runs a list of independent work items on the caller's thread and XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace vllm_xla {

template <typename Item>
struct SharedWork {
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Calls over at least this many rows are long enough that a time slice lost to preemption is a
// small part of them (see `Workers`).
constexpr int64_t kOversubscribedRows = 128;

// The threads that run the items of a call over `rows` rows, the caller included: one per core
// (`pool.num_threads()`), and one more from `kOversubscribedRows` rows. The caller runs on a core
// too (XLA's executor or one of the pool's threads), so a helper per pool thread puts one thread
// more than cores on the items: the scheduler then preempts one that holds an item and the whole
// call waits a time slice for it, which decides a short call (measured on two cores: a one-row
// decode step then ran at two speeds from stretch to stretch, at the faster one throughout with
// one thread a core) but costs a long one less than the extra thread gains (a long prefill step
// is slightly faster with it).
inline int64_t Workers(xla::ffi::ThreadPool& pool, int64_t rows) {
  const int64_t cores = std::max<int64_t>(1, pool.num_threads());
  return rows >= kOversubscribedRows ? cores + 1 : cores;
}

// Runs `problem.Run(item)` for every item on `workers` threads (`Workers`): the caller and
// helpers from `pool`, taking items from a shared counter, and returns when all ran. A thread
// that takes an item calls `Problem::Begin()` first and `Problem::End()` when none is left
// (static: per-thread state such as a tile configuration); helpers that start after the last item
// was taken return at once and touch only `work`, so the caller may return while they finish.
template <typename Problem, typename Item>
void RunAll(const Problem& problem, std::shared_ptr<SharedWork<Item>> work, xla::ffi::ThreadPool& pool,
            int64_t workers) {
  const int64_t total = static_cast<int64_t>(work->items.size());
  auto drain = [work, total, problem_ptr = &problem]() {
    int64_t i = work->next.fetch_add(1);
    if (i >= total) return;
    Problem::Begin();
    for (; i < total; i = work->next.fetch_add(1)) {
      problem_ptr->Run(work->items[i]);
      work->done.fetch_add(1, std::memory_order_release);
    }
    Problem::End();
  };
  const int64_t helpers = std::min<int64_t>(workers - 1, total - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(drain)(drain));  // a copy per task
  drain();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace vllm_xla
