// SPDX-License-Identifier: Apache-2.0
// float16 scales (GGUF's block scales d are float16) read as float32: every float16 value is a
// float32 one, so a kernel given float16 scales computes what float32 copies of them give.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace vllm_xla {

// A float16 value's bits as float32 (exact).
inline float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
  const uint32_t exponent = (half >> 10) & 0x1F, mantissa = half & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7F800000u : (exponent + 112) << 23) | (mantissa << 13);
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// `count` float16 values' bits as float32, eight an instruction where the CPU has F16C.
inline void WidenHalves(const uint16_t* from, int64_t count, float* to) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  }
#endif
  for (; i < count; ++i) to[i] = HalfToFloat(from[i]);
}

}  // namespace vllm_xla
