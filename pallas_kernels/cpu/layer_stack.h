// SPDX-License-Identifier: Apache-2.0
// One layer of a dense kernel's operand given either as that layer alone or as the stack of
// every layer's ([L, ...]), with the layer's index as the call's `layer` attribute. The step
// program passes the weights of identical layers as one argument each (fewer arguments make the
// runtime's execute call cheaper), and every way XLA:CPU has to take layer i out of a stack
// (a slice, a scan) copies its weights: the kernels read layer i in place instead.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace vllm_xla {

struct LayerOperand {
  xla::ffi::Span<const int64_t> dims;  // the layer's own
  int64_t offset = 0;                  // elements before the layer in the buffer
  bool ok = false;                     // the index lies in the stack (0 for a single layer)
};

// Layer `layer` of an operand of dimensions `d`: `stacked` says whether the operand is a stack
// (its first dimension the layers), as the call's weight says for every per-layer operand.
inline LayerOperand LayerOf(xla::ffi::Span<const int64_t> d, bool stacked, int64_t layer) {
  if (!stacked) return {d, 0, layer == 0};
  if (d.size() == 0) return {d, 0, false};
  const xla::ffi::Span<const int64_t> own(d.begin() + 1, d.size() - 1);
  int64_t elements = 1;
  for (const int64_t n : own) elements *= n;
  return {own, layer * elements, layer >= 0 && layer < d[0]};
}

}  // namespace vllm_xla
