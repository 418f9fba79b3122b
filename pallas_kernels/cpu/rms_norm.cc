// SPDX-License-Identifier: Apache-2.0
// RMSNorm as XLA FFI handlers, with the residual add before it in the same pass:
//
//   rms_norm:      out = round(x * rsqrt(mean(x^2) + eps) * w)
//   add_rms_norm:  sum = round(x + residual); out = rms_norm(sum)
//
// x (and residual, sum, out) are float32 or bfloat16 `[..., D]`, normalized over the last axis
// in float32 and rounded once to their dtype, as `models.RMSNorm` computes them on XLA; `w` is
// float32 or bfloat16 `[D]`, or the `layer`-th row of a `[L, D]` stack (`models.layer_stacks`),
// `1 + w` with `unit_offset`. On XLA:CPU the same norm is five small ops (the add, the squares,
// the mean, the rsqrt, the scaling), each its own dispatch, which at a few rows costs more than
// their arithmetic.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "kv_values.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows an item holds: about this many values, so that a helper thread's wake-up is worth it.
constexpr int64_t kValuesPerItem = 32768;

struct Item {
  int64_t first, end;  // rows [first, end)
};

// Value: float, or uint16_t for bfloat16 bits (x, residual, sum, out); Weight likewise.
template <typename Value, typename Weight>
struct Problem {
  const Value* x;
  const Value* residual;  // null: no add
  const Weight* weight;   // [D]: the layer's row
  Value* sum;             // null: no add
  Value* out;
  int64_t width;
  float eps;
  bool unit_offset;

  static void Begin() {}
  static void End() {}

  static float Round(float v) {
    if constexpr (std::is_same_v<Value, uint16_t>) return vllm_xla::RoundToBf16(v);
    return v;
  }

  void Run(const Item& item) const {
    for (int64_t t = item.first; t < item.end; ++t) NormRow(t * width);
  }

  void NormRow(int64_t at) const {
    const Value* source = residual == nullptr ? x + at : sum + at;
    if (residual != nullptr) {
      for (int64_t i = 0; i < width; ++i) {
        const float added = Round(vllm_xla::Load(x + at, i) + vllm_xla::Load(residual + at, i));
        vllm_xla::Store(sum + at, i, added);  // exact: `added` is already a Value
      }
    }
    float squares = 0.0f;
    for (int64_t i = 0; i < width; ++i) {
      const float v = vllm_xla::Load(source, i);
      squares += v * v;
    }
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
    const float offset = unit_offset ? 1.0f : 0.0f;
    for (int64_t i = 0; i < width; ++i) {
      const float w = vllm_xla::Load(weight, i) + offset;
      vllm_xla::Store(out + at, i, vllm_xla::Load(source, i) * scale * w);
    }
  }
};

template <typename Value, typename Weight>
void RunAll(Problem<Value, Weight> problem, int64_t rows, ffi::ThreadPool& pool) {
  const int64_t per_item = std::max<int64_t>(1, kValuesPerItem / std::max<int64_t>(1, problem.width));
  auto work = std::make_shared<vllm_xla::SharedWork<Item>>();
  for (int64_t t = 0; t < rows; t += per_item) work->items.push_back({t, std::min(rows, t + per_item)});
  if (work->items.empty()) return;
  vllm_xla::RunAll(problem, work, pool, vllm_xla::Workers(pool, rows));
}

bool IsFloat(ffi::DataType type) { return type == ffi::DataType::F32 || type == ffi::DataType::BF16; }

// Dispatches on the value and weight dtypes; `residual`/`sum` null for a norm without the add.
ffi::Error Norm(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                const ffi::AnyBuffer& weight, ffi::AnyBuffer* sum, ffi::AnyBuffer& out, float eps,
                int64_t layer, bool unit_offset) {
  const auto xd = x.dimensions();
  const auto wd = weight.dimensions();
  if (xd.size() < 1 || !IsFloat(x.element_type()) || !IsFloat(weight.element_type())) {
    return ffi::Error::InvalidArgument("x and the weight must be float32 or bfloat16");
  }
  const int64_t width = xd.back();
  const bool stacked = wd.size() == 2;
  if ((wd.size() != 1 && !stacked) || wd.back() != width || (stacked != (layer >= 0)) ||
      (stacked && layer >= wd[0])) {
    return ffi::Error::InvalidArgument("the weight must be [D], or [L, D] with 0 <= layer < L");
  }
  if (out.element_type() != x.element_type() || out.element_count() != x.element_count() ||
      (residual != nullptr && (residual->element_type() != x.element_type() ||
                               residual->element_count() != x.element_count() ||
                               sum->element_type() != x.element_type() ||
                               sum->element_count() != x.element_count()))) {
    return ffi::Error::InvalidArgument("residual, sum and out must be x's dtype and size");
  }
  const int64_t rows = width == 0 ? 0 : static_cast<int64_t>(x.element_count()) / width;
  const int64_t row = stacked ? layer * width : 0;
  auto run = [&](auto value, auto weight_value) {
    using Value = decltype(value);
    using Weight = decltype(weight_value);
    auto typed = [](const ffi::AnyBuffer* buffer) {
      return buffer == nullptr ? nullptr : static_cast<Value*>(buffer->untyped_data());
    };
    Problem<Value, Weight> problem{
        typed(&x),  typed(residual), static_cast<const Weight*>(weight.untyped_data()) + row,
        typed(sum), typed(&out),     width,
        eps,        unit_offset};
    RunAll(problem, rows, pool);
  };
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const bool bf16_weight = weight.element_type() == ffi::DataType::BF16;
  if (bf16 && bf16_weight) run(uint16_t{}, uint16_t{});
  if (bf16 && !bf16_weight) run(uint16_t{}, float{});
  if (!bf16 && bf16_weight) run(float{}, uint16_t{});
  if (!bf16 && !bf16_weight) run(float{}, float{});
  return ffi::Error::Success();
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> out,
                   float eps, int64_t layer, bool unit_offset) {
  return Norm(pool, x, nullptr, weight, nullptr, *out, eps, layer, unit_offset);
}

ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> sum, float eps, int64_t layer,
                      bool unit_offset) {
  return Norm(pool, x, &residual, weight, &*sum, *out, eps, layer, unit_offset);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("layer")
                                  .Attr<bool>("unit_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaAddRmsNorm, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("layer")
                                  .Attr<bool>("unit_offset"));
