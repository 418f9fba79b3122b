// SPDX-License-Identifier: Apache-2.0
// The AVX-512 BF16 register block of the bfloat16 dense kernel (dense.cc), shared with the int8
// and int4 kernels (dense_int8.cc, dense_int4_pairs.h), which widen their panels to this layout
// once for many rows; the CPU probe, the rounding to pairs and the aligned scratch they share.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#if defined(__x86_64__)
#include <immintrin.h>

namespace vllm_xla {

constexpr int kBf16VectorRows = 6;    // rows of x in a register block
constexpr int kBf16VectorBlocks = 4;  // 16-column blocks in a register block: 24 accumulators

#define VLLM_XLA_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Whether this CPU has AVX-512 BF16 (leaf 7, subleaf 1, EAX bit 5) besides AVX-512 F and BW, and
// the operating system saves the AVX-512 state.
inline bool Avx512Bf16Usable() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return false;
  unsigned eax, ebx, ecx, edx;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(1));
  return eax & (1u << 5);
}

// Scratch for a work item's widened panels: 64-byte aligned, so that each 64-byte row the register
// blocks load is one cache line (a split load costs two), and left uninitialized (every value is
// written before it is read).
class AlignedPairs {
 public:
  explicit AlignedPairs(int64_t values)
      : data_(static_cast<uint16_t*>(::operator new(values * sizeof(uint16_t), std::align_val_t{64}))) {}
  ~AlignedPairs() { ::operator delete(data_, std::align_val_t{64}); }
  AlignedPairs(const AlignedPairs&) = delete;
  AlignedPairs& operator=(const AlignedPairs&) = delete;
  uint16_t* data() const { return data_; }

 private:
  uint16_t* data_;
};

// This thread's scratch of at least `values` bfloat16 values (contents undefined), kept from one
// work item and call to the next: allocated afresh, an item's half megabyte of widened panels
// came back from the allocator as pages handed back to the kernel, faulted in and zeroed on first
// write, for every item of every call. Per thread, so the pool's threads never share one.
inline uint16_t* ThreadPairs(int64_t values) {
  thread_local std::unique_ptr<AlignedPairs> pairs;
  thread_local int64_t capacity = 0;
  if (values > capacity) {
    pairs.reset();  // the old one first: the two need not fit at once
    pairs = std::make_unique<AlignedPairs>(values);
    capacity = values;
  }
  return pairs->data();
}

// Two float32 vectors (the 16 columns of k and of k + 1) rounded to bfloat16 (to nearest even) as
// one pair a 32-bit lane, k in the low half: a row of the pairs layout [K/2, 16, 2].
// VCVTNE2PS2BF16 rounds both vectors at once (k's 16 values, then k + 1's) and VPERMW interleaves them.
VLLM_XLA_AVX512BF16 inline __m512i RoundToPairs(__m512 even, __m512 odd) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// 16 scales (or offsets) of a panel from float32, or from float16 bits widened exactly (GGUF's
// own d and minimum, read as they are: widening all of a weight's to float32 first would be a
// serial pass over them before the threads start, a few percent of a 64-row call).
VLLM_XLA_AVX512BF16 inline __m512 LoadPanelScales(const float* at) { return _mm512_loadu_ps(at); }
VLLM_XLA_AVX512BF16 inline __m512 LoadPanelScales(const uint16_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// y[0 : R, 0 : 16 C] (row stride `y_stride`) = x[0 : R, 0 : K] (bfloat16, row stride K) @ C
// column panels [K/2, 16, 2] (bfloat16 pairs, `panel` uint16 values apart), accumulated over all
// of K in registers with VDPBF16PS: a packed tile row (16 columns x one pair of K) against a
// broadcast pair of x adds both products of the pair to 16 float32 accumulators. K even.
template <int R, int C>
VLLM_XLA_AVX512BF16 void Bf16VectorBlock(const uint16_t* x, const uint16_t* w, int64_t panel, int64_t K, float* y,
                                         int64_t y_stride) {
  const int64_t pairs = K / 2;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512i weights[C];
    for (int c = 0; c < C; ++c) weights[c] = _mm512_loadu_si512(w + c * panel + pair * 32);
    for (int r = 0; r < R; ++r) {
      int32_t both;
      std::memcpy(&both, x + r * K + 2 * pair, sizeof(both));
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(both);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xs, (__m512bh)weights[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + r * y_stride + c * 16, acc[r][c]);
}

using Bf16VectorBlockKernel = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*, int64_t);

// The register block for `rows` (1 to kBf16VectorRows) rows by `blocks` (1 to kBf16VectorBlocks)
// column blocks.
inline Bf16VectorBlockKernel Bf16VectorBlockFor(int rows, int blocks) {
#define VLLM_XLA_ROW(R) {&Bf16VectorBlock<R, 1>, &Bf16VectorBlock<R, 2>, &Bf16VectorBlock<R, 3>, &Bf16VectorBlock<R, 4>}
  static constexpr Bf16VectorBlockKernel kKernels[kBf16VectorRows][kBf16VectorBlocks] = {
      VLLM_XLA_ROW(1), VLLM_XLA_ROW(2), VLLM_XLA_ROW(3), VLLM_XLA_ROW(4), VLLM_XLA_ROW(5), VLLM_XLA_ROW(6)};
#undef VLLM_XLA_ROW
  return kKernels[rows - 1][blocks - 1];
}

}  // namespace vllm_xla

#endif  // __x86_64__
