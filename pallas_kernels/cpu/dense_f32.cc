// SPDX-License-Identifier: Apache-2.0
// float32 dense layers as an XLA FFI handler: y[M, N] = x[M, K] @ w[K, N], with AVX2 FMA.
//
// XLA:CPU's float32 dots run a few rows at a time (decode batches, short prompts) at a fraction of
// the FMA peak (measured on an AVX2 AMD EPYC: 20-31 GFLOP/s at 32 rows, against 60-73 from 64
// rows); this kernel keeps every FMA unit busy from one row on. It reads the weight as XLA holds
// it, row-major [K, N]: each 16-column block of a weight row is one 64-byte line, so a column
// block streams K lines at a fixed stride, which the hardware prefetchers follow. The same array
// then serves XLA's own dot for many rows (the caller picks per step size). N must be a multiple
// of 16.
//
// Work items are runs of 16-column blocks (two per thread), walked in register blocks of up to
// 6 rows by 16 columns (12 accumulators).

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "dense_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__x86_64__)
#define VLLM_XLA_AVX2 __attribute__((target("avx2,fma")))

using vllm_xla::Item;

constexpr int kRows = 6;  // rows of x in a register block (two 8-column halves each)
constexpr int64_t kCols = 16;

struct F32Problem {
  const float* x;  // [M, K]
  const float* w;  // [N/16, K, 16]
  float* y;        // [M, N]
  int64_t M, K, N;

  static void Begin() {}
  static void End() {}

  void Run(const Item& item) const {
    vllm_xla::WalkRegisterBlocks(item, M, K * static_cast<int64_t>(sizeof(float)), kRows, 1,
                                 [&](int64_t row, int rows, int64_t block, int) {
                                   kRowKernels[rows - 1](*this, row, block);
                                 });
  }

  // y[row : row + R, block * 16 : block * 16 + 16], accumulated over all of K in registers. With
  // one or two rows, even and odd k accumulate apart, so enough FMA chains run at once.
  template <int R>
  VLLM_XLA_AVX2 static void Block(const F32Problem& p, int64_t row, int64_t block) {
    constexpr int kChains = R <= 2 ? 2 : 1;
    const int64_t K = p.K;  // in a register: the stores below could alias `p` for the compiler
    const float* __restrict w = p.w + block * K * kCols;
    const float* __restrict x = p.x + row * K;
    __m256 acc[R][2][kChains];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm256_setzero_ps();
    const int64_t steps = K / kChains * kChains;
    for (int64_t k = 0; k < steps; k += kChains) {
      for (int c = 0; c < kChains; ++c) {
        const float* line = w + (k + c) * kCols;
        const __m256 low = _mm256_loadu_ps(line), high = _mm256_loadu_ps(line + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 xs = _mm256_set1_ps(x[r * K + k + c]);
          acc[r][0][c] = _mm256_fmadd_ps(low, xs, acc[r][0][c]);
          acc[r][1][c] = _mm256_fmadd_ps(high, xs, acc[r][1][c]);
        }
      }
    }
    if constexpr (kChains == 2) {
      if (steps < K) {  // an odd K's last row
        const float* line = w + steps * kCols;
        const __m256 low = _mm256_loadu_ps(line), high = _mm256_loadu_ps(line + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 xs = _mm256_set1_ps(x[r * K + steps]);
          acc[r][0][0] = _mm256_fmadd_ps(low, xs, acc[r][0][0]);
          acc[r][1][0] = _mm256_fmadd_ps(high, xs, acc[r][1][0]);
        }
      }
    }
    float* y = p.y + row * p.N + block * kCols;
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        __m256 sum = acc[r][h][0];
        if constexpr (kChains == 2) sum = _mm256_add_ps(sum, acc[r][h][1]);
        _mm256_storeu_ps(y + r * p.N + h * 8, sum);
      }
    }
  }

  using BlockKernel = void (*)(const F32Problem&, int64_t, int64_t);
  static constexpr BlockKernel kRowKernels[kRows] = {&Block<1>, &Block<2>, &Block<3>,
                                                     &Block<4>, &Block<5>, &Block<6>};
};

// Whether this process may run the kernel, probed once.
bool Usable() {
  static const bool usable = vllm_xla::Avx2Usable();
  return usable;
}

ffi::Error DenseF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] != kCols) {
    return ffi::Error::InvalidArgument("expected x [M, K] and a packed weight [N/16, K, 16]");
  }
  if (!Usable()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "the float32 dense kernel needs AVX2 with FMA");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0] * kCols;
  if (M == 0) return ffi::Error::Success();
  const int64_t cached_blocks = vllm_xla::CachedBlocks(K, sizeof(float));
  vllm_xla::RunOverColumnBlocks(F32Problem{x.typed_data(), w.typed_data(), y->typed_data(), M, K, N},
                                N / kCols, std::max<int64_t>(2, cached_blocks), pool);
  return ffi::Error::Success();
}

#else  // not x86-64

bool Usable() { return false; }

ffi::Error DenseF32(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "the float32 dense kernel needs an x86-64 CPU");
}

#endif

}  // namespace

// Whether this process may run the float32 dense kernel (AVX2 with FMA).
extern "C" int VllmXlaDenseF32Usable() { return Usable() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaDenseF32, DenseF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
