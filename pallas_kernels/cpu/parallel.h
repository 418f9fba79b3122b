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

// Runs `problem.Run(item)` for every item, taken from a shared counter by the caller and up to
// `pool.num_threads()` helpers, and returns when all ran. A thread that takes an item calls
// `Problem::Begin()` first and `Problem::End()` when none is left (static: per-thread state such
// as a tile configuration); helpers that start after the last item was taken return at once and
// touch only `work`, so the caller may return while they finish.
template <typename Problem, typename Item>
void RunAll(const Problem& problem, std::shared_ptr<SharedWork<Item>> work, xla::ffi::ThreadPool& pool) {
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
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(drain)(drain));  // a copy per task
  drain();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace vllm_xla
