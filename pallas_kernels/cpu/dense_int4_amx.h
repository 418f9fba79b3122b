// SPDX-License-Identifier: Apache-2.0
// The int4 kernel's path for many rows of bfloat16 x on AMX (dense_int4.cc, "amx"): each work item's
// packed panels dequantized once to q s + m in bfloat16 pairs (`WidenInt4Panel`, the pairs the
// "avx512_bf16" path writes), then every row multiplied on AMX tiles (`AmxProduct`, the bfloat16
// kernel's): the product of the weights as a bfloat16 checkpoint would hold them, at AMX's speed.
// A panel is widened once a call and reread from L2 by every row pass; at the row counts this
// path takes, the widening is a small share of the products.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include "dense_amx.h"
#include "dense_avx512_bf16.h"
#include "dense_blocks.h"
#include "dense_int4_avx2.h"
#include "dense_int4_pairs.h"

namespace vllm_xla {
namespace int4 {

struct AmxInt4 : Int4Problem {
  const uint16_t* x_bits;       // [Mp, K] bfloat16, rows padded to a multiple of 16 (`AmxRows`)
  int64_t Mp;
  const uint16_t* half_scale;   // float16 bits of the scales (then `scale` and `offset` are null), or null
  const uint16_t* half_offset;  // float16 bits of the offsets, or null

  static void Begin() { AmxBegin(); }
  static void End() { AmxEnd(); }

  void Run(const Item& item) const { RunWithScales(*this, item); }

  template <typename Scale>
  void RunWith(const Item& item, const Scale* scales, const Scale* offsets) const {
    const int64_t panel = K * kCols;
    uint16_t* pairs = ThreadPairs((item.end_block - item.first_block) * panel);
    for (int64_t block = item.first_block; block < item.end_block; ++block) {
      const int64_t column = block * kCols;
      const Int4Panels<Scale> panels{w + block * (K / kWordDepth) * kCols, scales + column,
                                     offsets != nullptr ? offsets + column : nullptr, scale_in_base, N, K, group};
      WidenInt4Panel(panels, pairs + (block - item.first_block) * panel);
    }
    const AmxProduct product{x_bits, y, M, Mp, K, N};
    product.Multiply(pairs, item.first_block, item.end_block, /*from_memory=*/false);
  }
};

}  // namespace int4
}  // namespace vllm_xla

#endif  // __x86_64__
