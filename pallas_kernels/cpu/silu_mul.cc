// SPDX-License-Identifier: Apache-2.0
// SwiGLU's elementwise half as an XLA FFI handler: `out = silu(gate) * up` from a fused gate/up
// projection's float32 products `[T, 2I]` (gate columns, then up columns).
//
// For a bfloat16 output, gate and up are first rounded to bfloat16 (the projection's output
// dtype) and silu's result is rounded before the product, as PyTorch computes `act(gate) * up`
// on bfloat16 tensors: each op in float32, rounded once. Trailing all-zero rows (a step's padding
// tokens) are written as zeros without computing them. XLA:CPU evaluates the same function on
// bfloat16 as a chain of scalar ops, each rounded, about twice as slowly as these calls in a
// prefill step of the embedded model (traced).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "dense_blocks.h"
#include "fast_math.h"
#include "kv_values.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerItem = 8;

struct Item {
  int64_t first, end;  // rows [first, end)
};

// Out: float, or uint16_t for bfloat16 bits.
template <typename Out>
struct Problem {
  const float* gate_up;  // [T, 2I]
  Out* out;              // [T, I]
  int64_t width;         // I

  static void Begin() {}
  static void End() {}

  static float Round(float x) {
    if constexpr (std::is_same_v<Out, uint16_t>) return vllm_xla::RoundToBf16(x);
    return x;
  }
  static Out Convert(float x) {
    if constexpr (std::is_same_v<Out, uint16_t>) return vllm_xla::FloatToBf16Bits(x);
    return x;
  }

  void Run(const Item& item) const {
    for (int64_t t = item.first; t < item.end; ++t) {
      const float* gate = gate_up + t * 2 * width;
      const float* up = gate + width;
      Out* row = out + t * width;
      for (int64_t i = 0; i < width; ++i) {
        row[i] = Convert(Round(vllm_xla::Silu(Round(gate[i]))) * Round(up[i]));
      }
    }
  }
};

template <typename Out>
void RunAll(const float* gate_up, Out* out, int64_t rows, int64_t width, ffi::ThreadPool& pool) {
  const auto* bits = reinterpret_cast<const uint32_t*>(gate_up);  // +0 and -0 rows alike
  const int64_t used = vllm_xla::RowsBeforeZeroTail<uint32_t>(bits, rows, 2 * width, 0x7fffffffu);
  std::memset(out + used * width, 0, sizeof(Out) * (rows - used) * width);
  auto work = std::make_shared<vllm_xla::SharedWork<Item>>();
  for (int64_t t = 0; t < used; t += kRowsPerItem) work->items.push_back({t, std::min(used, t + kRowsPerItem)});
  if (work->items.empty()) return;
  vllm_xla::RunAll(Problem<Out>{gate_up, out, width}, work, pool, vllm_xla::Workers(pool, used));
}

ffi::Error SiluMul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gate_up, ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = gate_up.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2 || xd[0] != od[0] || xd[1] != 2 * od[1]) {
    return ffi::Error::InvalidArgument("expected gate_up [T, 2I] and out [T, I]");
  }
  const float* x = gate_up.typed_data();
  if (out->element_type() == ffi::DataType::F32) {
    RunAll(x, static_cast<float*>(out->untyped_data()), od[0], od[1], pool);
  } else if (out->element_type() == ffi::DataType::BF16) {
    RunAll(x, static_cast<uint16_t*>(out->untyped_data()), od[0], od[1], pool);
  } else {
    return ffi::Error::InvalidArgument("out must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaSiluMul, SiluMul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());
