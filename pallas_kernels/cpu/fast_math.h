// SPDX-License-Identifier: Apache-2.0
// Elementwise math the native kernels share, written so that loops over rows vectorize.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace vllm_xla {

// exp(x) for x <= 0 (a softmax's shifted scores), as plain float and int arithmetic that
// compilers vectorize: 2^n * p(r) with a degree-6 polynomial, relative error < 2e-7.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The largest of x[begin..end) and `init`, in 16 lanes: a running maximum is a chain of dependent
// compares the compiler does not reorder without -ffast-math (a fifth of a prefill call's time).
inline float MaxOf(const float* x, int64_t begin, int64_t end, float init) {
  float lanes[16];
  for (float& lane : lanes) lane = init;
  int64_t j = begin;
  for (; j + 16 <= end; j += 16) {
    for (int i = 0; i < 16; ++i) lanes[i] = std::max(lanes[i], x[j + i]);
  }
  float result = init;
  for (const float lane : lanes) result = std::max(result, lane);
  for (; j < end; ++j) result = std::max(result, x[j]);
  return result;
}

// silu(x) = x * sigmoid(x) in float32 (relative error a few ulp): the exponential is always of
// -|x|, so it neither overflows nor needs a branch.
inline float Silu(float x) {
  const float e = ExpNonPositive(-std::fabs(x));
  const float sigmoid = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
  return x * sigmoid;
}

}  // namespace vllm_xla
