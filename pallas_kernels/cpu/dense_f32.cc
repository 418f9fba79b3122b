// SPDX-License-Identifier: Apache-2.0
// float32 dense layers as an XLA FFI handler: y[M, N] = x[M, K] @ w[K, N], with AVX2 FMA.
//
// XLA:CPU's float32 dots run a few rows at a time (decode batches, short prompts) at a fraction of
// the FMA peak (measured on an AVX2 AMD EPYC: well under half of what they reach from 64 rows);
// this kernel keeps every FMA unit busy from one row on. It reads the weight packed once
// into [N/16, K, 16] (`pack_dense_kernel_f32` in dense.py): each 16-column panel is K contiguous
// 64-byte lines, streamed in order. N must be a multiple of 16.
//
// Work items are runs of 16-column blocks (two per thread), walked in register blocks of up to
// 6 rows by 16 columns (12 accumulators).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dense_blocks.h"
#include "dense_f32_block.h"
#include "layer_stack.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__x86_64__)
using vllm_xla::Item;
using vllm_xla::kF32BlockCols;
using vllm_xla::kF32BlockRows;

struct F32Problem {
  const float* x;  // [M, K]
  const float* w;  // [N/16, K, 16]
  float* y;        // [M, N]
  int64_t M, K, N;

  static void Begin() {}
  static void End() {}

  void Run(const Item& item) const {
    vllm_xla::WalkRegisterBlocks(item, M, K * static_cast<int64_t>(sizeof(float)), kF32BlockRows, 1,
                                 [&](int64_t row, int rows, int64_t block, int) {
                                   vllm_xla::F32BlockFor(rows)(x + row * K, w + block * K * kF32BlockCols, K,
                                                               y + row * N + block * kF32BlockCols, N);
                                 });
  }
};

// Whether this process may run the kernel, probed once.
bool Usable() {
  static const bool usable = vllm_xla::Avx2Usable();
  return usable;
}

ffi::Error DenseF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y, int32_t layer) {
  const auto xd = x.dimensions();
  const auto weight = vllm_xla::LayerOf(w.dimensions(), w.dimensions().size() == 4, layer);
  const auto wd = weight.dims;
  if (!weight.ok || xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] != kF32BlockCols) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K] and a packed weight [N/16, K, 16] (or a stack of them holding `layer`)");
  }
  if (!Usable()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "the float32 dense kernel needs AVX2 with FMA");
  }
  const int64_t K = xd[1], N = wd[0] * kF32BlockCols;
  const auto* x_bits = reinterpret_cast<const uint32_t*>(x.typed_data());
  const int64_t M = vllm_xla::RowsBeforeZeroTail<uint32_t>(x_bits, xd[0], K, 0x7fffffffu);
  std::memset(y->typed_data() + M * N, 0, sizeof(float) * (xd[0] - M) * N);
  if (M == 0) return ffi::Error::Success();
  const int64_t cached_blocks = vllm_xla::CachedBlocks(K, sizeof(float));
  vllm_xla::RunOverColumnBlocks(F32Problem{x.typed_data(), w.typed_data() + weight.offset, y->typed_data(), M, K, N},
                                N / kF32BlockCols, std::max<int64_t>(2, cached_blocks), pool);
  return ffi::Error::Success();
}

#else  // not x86-64

bool Usable() { return false; }

ffi::Error DenseF32(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::F32>,
                    int32_t) {
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("layer"));
