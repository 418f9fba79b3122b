// SPDX-License-Identifier: Apache-2.0
// The KV cache's element types, their widening to float32 (scalar, and 16 or 8 at a time) and
// their rounding from it (scalar), plus the vector operations of the decode update for AVX-512 and for AVX2.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace vllm_xla {

// Float8 values: one byte of bits each, told apart by type.
struct E4M3 {
  uint8_t bits;  // 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities
};
struct E5M2 {
  uint8_t bits;  // 1 sign, 5 exponent (bias 15), 2 mantissa bits: the top byte of a float16
};
static_assert(sizeof(E4M3) == 1 && sizeof(E5M2) == 1);

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// A float8 value with kE exponent and kM mantissa bits as float32, exactly (NaN patterns are not
// written: values saturate when stored). Branch-free, so the loops that convert a row vectorize:
// a normal value's exponent and mantissa move into float32's fields with the bias raised, a
// subnormal one (exponent 0) is its mantissa times the smallest subnormal.
template <int kE, int kM>
inline float Float8ToFloat(uint8_t b) {
  constexpr uint32_t kBias = (1u << (kE - 1)) - 1;
  const uint32_t magnitude = b & 0x7Fu;
  const float normal = BitsToFloat((magnitude << (23 - kM)) + ((127u - kBias) << 23));
  const float subnormal = static_cast<float>(magnitude) * (1.0f / static_cast<float>(1u << (kBias - 1 + kM)));
  const float value = magnitude < (1u << kM) ? subnormal : normal;
  return BitsToFloat(FloatToBits(value) | (static_cast<uint32_t>(b & 0x80u) << 24));
}

inline float Load(const uint16_t* p, int64_t i) { return BitsToFloat(static_cast<uint32_t>(p[i]) << 16); }
inline float Load(const float* p, int64_t i) { return p[i]; }
inline float Load(const E4M3* p, int64_t i) { return Float8ToFloat<4, 3>(p[i].bits); }
inline float Load(const E5M2* p, int64_t i) { return Float8ToFloat<5, 2>(p[i].bits); }

// float32 to bfloat16 bits, rounded to nearest even as XLA's convert does (NaN stays a quiet NaN).
// Branch-free, so loops over rows vectorize.
inline uint16_t FloatToBf16Bits(float f) {
  const uint32_t bits = FloatToBits(f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

// `f` as a bfloat16 value would hold it (`FloatToBf16Bits`), back in float32.
inline float RoundToBf16(float f) { return BitsToFloat(static_cast<uint32_t>(FloatToBf16Bits(f)) << 16); }

// float32 to the float8 with kE exponent and kM mantissa bits, rounded to nearest even after
// saturating at the largest finite value `max_finite` (as `reference.saturating_cast` stores them); NaN
// becomes the format's quiet NaN `kNan` with the sign kept.
template <int kE, int kM, uint32_t kNan>
inline uint8_t FloatToFloat8(float f, float max_finite) {
  constexpr int kBias = (1 << (kE - 1)) - 1;
  const uint32_t bits = FloatToBits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint8_t>(sign | kNan);
  const float magnitude = std::min(std::fabs(f), max_finite);
  const float smallest_normal = BitsToFloat(static_cast<uint32_t>(127 + 1 - kBias) << 23);
  if (magnitude < smallest_normal) {  // subnormal (or the smallest normal, reached by rounding up)
    const float units = std::nearbyint(magnitude * BitsToFloat(static_cast<uint32_t>(127 + kBias - 1 + kM) << 23));
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(units));
  }
  const uint32_t m = FloatToBits(magnitude);
  constexpr int kDrop = 23 - kM;
  const uint32_t rounded = (m + ((1u << (kDrop - 1)) - 1u) + ((m >> kDrop) & 1u)) >> kDrop;
  return static_cast<uint8_t>(sign | (rounded - (static_cast<uint32_t>(127 - kBias) << kM)));
}

// Starts loading `count` consecutive elements at `at` into L2, a software prefetch a 64-byte line:
// how the decode update reads ahead, a few lines with each key (a burst would fill the core's miss
// queue and stall the loads behind it).
template <typename T>
inline void LoadIntoL2(const T* at, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(at);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b, 0, 2);
}

// What a call whose cache fails `WithCacheType` is told.
inline constexpr char kCacheTypeError[] =
    "kv_cache must be float32 (cache_format 0), uint16 bfloat16 bits (1) or uint8 float8 bits (2: e4m3fn, 3: e5m2)";

// Calls `f(T{})` with the element type T of a cache whose `cache_format` attribute (0 float32,
// 1 bfloat16 bits, 2 float8_e4m3fn bits, 3 float8_e5m2 bits) matches its buffer's `type`; false,
// without calling it, when they do not match.
template <typename F>
bool WithCacheType(int32_t cache_format, xla::ffi::DataType type, F&& f) {
  using xla::ffi::DataType;
  if (cache_format == 0 && type == DataType::F32) {
    f(float{});
  } else if (cache_format == 1 && type == DataType::U16) {
    f(uint16_t{});
  } else if (cache_format == 2 && type == DataType::U8) {
    f(E4M3{});
  } else if (cache_format == 3 && type == DataType::U8) {
    f(E5M2{});
  } else {
    return false;
  }
  return true;
}

// One value stored into a cache of each element type.
inline void Store(float* p, int64_t i, float x) { p[i] = x; }
inline void Store(uint16_t* p, int64_t i, float x) { p[i] = FloatToBf16Bits(x); }
inline void Store(E4M3* p, int64_t i, float x) { p[i].bits = FloatToFloat8<4, 3, 0x7Fu>(x, 448.0f); }
inline void Store(E5M2* p, int64_t i, float x) { p[i].bits = FloatToFloat8<5, 2, 0x7Eu>(x, 57344.0f); }

#if defined(__AVX512F__)
// 16 consecutive values as float32 (bfloat16 bits widen by a shift).
inline __m512 Load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
// e5m2 is the top byte of a float16: shift it up and convert.
inline __m512 Load16(const E5M2* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}
// e4m3 as a float16 whose exponent has bias 15, not 7: its magnitude bits move up 7 (into
// float16's exponent and mantissa fields) and the sign up 8, and the float32 value is then
// 2^8 too small, subnormals included (float16's subnormals hold e4m3's exactly).
inline __m256i E4M3ToHalfBits(__m256i x) {  // 16 values, one a 16-bit lane
  const __m256i magnitude = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(0x3F80));
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(x, 8), _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
  return _mm256_or_si256(magnitude, sign);
}
inline __m512 Load16(const E4M3* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512 scaled = _mm512_cvtph_ps(E4M3ToHalfBits(_mm256_cvtepu8_epi16(bytes)));
  return _mm512_mul_ps(scaled, _mm512_set1_ps(256.0f));
}

// The decode update's vector operations, 16 lanes.
struct Avx512 {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  template <typename T>
  static Reg Load(const T* p) { return Load16(p); }
  static Reg LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
  static Reg Mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg Fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg Set1(float x) { return _mm512_set1_ps(x); }
  static float Sum(Reg x) { return _mm512_reduce_add_ps(x); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VLLM_XLA_AVX2_DECODE 1
// 8 consecutive values as float32, as Load16 does for 16.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 Load8(const E5M2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}
// e4m3 through float16, as Load16 does.
inline __m256 Load8(const E4M3* p) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(0x3F80));
  const __m128i sign = _mm_and_si128(_mm_slli_epi16(x, 8), _mm_set1_epi16(static_cast<int16_t>(0x8000)));
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(magnitude, sign)), _mm256_set1_ps(256.0f));
}

// The decode update's vector operations, 8 lanes (CPUs without AVX-512).
struct Avx2 {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  template <typename T>
  static Reg Load(const T* p) { return Load8(p); }
  static Reg LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
  static Reg Mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg Fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg Set1(float x) { return _mm256_set1_ps(x); }
  static float Sum(Reg x) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
  }
};
#endif

}  // namespace vllm_xla
