// SPDX-License-Identifier: Apache-2.0
// 4-bit-weight dense layers (W4A16) as an XLA FFI handler: y[M, N] (float32) = x[M, K] @ w with
// w = q * s + m, q int4 in [-8, 7] packed two a byte, s a float32 scale per group of G consecutive
// k and column (scale [K/G, N]; G = K: one per column, scale [N]) and m an optional float32 offset
// of the scale's layout (affine 4-bit: zero points, GGUF Q4_1's block minimums). x is bfloat16 or
// float32. Scales and offsets may be float16 instead (both), and the offsets the bases b
// themselves (attribute `bases`), w = u s + b: a GGUF Q4_1 block's own d and minimum, exact, 4
// bytes per 32 weights instead of float32's 8 (see `GroupScales`).
//
// Decode streams every weight once a step, so its speed is the weights' bytes: half of int8's, a
// quarter of bfloat16's, as long as unpacking keeps pace. The values are never dequantized to
// memory at a few rows. They are stored unsigned, u = q + 8 in [0, 15], so each group's sum is
// x . w = s (x . u) + (m - 8 s) (sum of x): the products with u, then each row's sum of x over
// the group (computed once per call) times the group's base m - 8 s.
//
// The weight is packed once into [N/16, K/8, 16] uint32 (`pack_dense_kernel_int4` in
// dense_int4.py): each 16-column panel is K/8 contiguous 64-byte lines, each 32-bit word one
// column's eight consecutive k, byte b holding k = b in its low nibble and k = b + 4 in its high
// one. K must be a multiple of 8 and N of 16, G a multiple of 8 that divides K.
//
// Paths ("isa"):
// - "avx2" (the default for bfloat16 x), up to `kWidenAheadAbove` rows: integer products. x is
//   rounded per row to 16-bit fixed point (sx = max|x_row| / 32639, x16 = rint(x / sx)), split
//   into two signed byte planes, x16 = 256 hi + lo, as the int8 kernel's VNNI path does. An AND
//   (low nibbles: k 0-3 of each column) or a shift and an AND (high nibbles: k 4-7) give 32 bytes
//   of u that are VPMADDUBSW's unsigned operand as they lie, against four broadcast bytes of a
//   plane: 32 products an instruction, summed in pairs into int16 lanes (at most 2 * 15 * 128 a
//   pair, so four lines of them fit an int16 before they widen to int32 and float32). That is a
//   quarter of the instructions of widening every value to float32, whose cost would otherwise
//   exceed the bytes it saves. The one error next to the float product is x's rounding to 16 bits
//   (finer than bfloat16's own): at most sx / 2 sum_k |u_k s_k| per output. A call with a value of
//   x that is not finite, or a row whose largest magnitude is below 1e-30 but not zero, takes
//   "avx2_float" instead.
// - "avx2_float" (the default for float32 x without AVX-512): the same walk with the nibbles
//   widened to float32 in registers (a shift, an AND and a convert) against x in float32: the
//   float product.
// - both, above `kWidenAheadAbove` rows: each panel dequantized once per chunk of rows to float32
//   [K, 16] (u s + m - 8 s), the rows then on the float32 kernel's 6x16 register blocks.
// - "avx512_bf16" (the default for bfloat16 x where the CPU has AVX-512 BF16): as "avx2" up to
//   `kWidenAheadAbove` rows; above, each panel of a work item dequantized once to q s + m in
//   bfloat16 by the first register block over it (which multiplies the pairs as it writes them)
//   and the other rows on the bfloat16 kernel's VDPBF16PS blocks (dense_int4_pairs.h): the
//   one error next to the float product is the weights' rounding to bfloat16 (at most 2^-8 of
//   each |x w| term). Float32 x takes the float product.
// - "amx" (where the CPU has AMX bfloat16 tiles): as "avx2" up to `kWidenAheadAbove` rows; above,
//   each panel of a work item dequantized once to the same bfloat16 pairs as "avx512_bf16", then
//   every row multiplied on AMX tiles (dense_int4_amx.h): the same one error, several times the
//   throughput at many rows. K must be a multiple of 32, else "avx512_bf16" runs. Float32 x
//   takes the float product.
// - "avx512_vnni" (the default for bfloat16 x where the CPU has AVX-512 VNNI and VBMI), up to
//   `kVnniRowsAtMost` rows: the "avx2" path's fixed point with VPDPBUSD (dense_int4_vnni.h);
//   above, as "amx" where the CPU has it, else "avx512_bf16", else "avx2". Float32 x takes
//   the float product.
// - "avx512_float" (the default for float32 x where the CPU has AVX-512): "avx2_float"'s float
//   product with a whole panel line a register, up to 8 rows sharing each widened line
//   (dense_int4_avx512_float.h); many rows as "avx2_float", on 12x16 AVX-512 register blocks
//   instead of its 6x16 AVX2 ones.
// - "portable": plain C++ (vectorized by the compiler), the float product, on any CPU.
//
// Work items are runs of 16-column blocks (`RunOverColumnBlocks`), walked in register blocks of a
// few rows by one panel.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "dense_int4_amx.h"
#include "dense_int4_avx512_float.h"
#include "dense_int4_vnni.h"
#endif

#include "dense_amx.h"
#include "dense_blocks.h"
#include "dense_int4_avx2.h"
#include "float16.h"
#include "layer_stack.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The `isa` attribute: which path runs (the codes of `DENSE_INT4_ISAS` in build.py).
enum Int4Isa : int32_t { kBestIsa = 0, kAvx2 = 1, kPortable = 2, kAvx2Float = 3, kAvx512Bf16 = 4, kAvx512Vnni = 5,
                       kAmx = 6, kAvx512Float = 7 };

using vllm_xla::int4::FixedPointRows;
using vllm_xla::int4::Int4Problem;
using vllm_xla::int4::kCols;
using vllm_xla::int4::kFixedLevels;
using vllm_xla::int4::kVnniRowsAtMost;
using vllm_xla::int4::kWidenAheadAbove;
using vllm_xla::int4::kWordDepth;
using vllm_xla::int4::PortableInt4;

// Rows up to which "avx512_vnni" takes x in one byte plane a block by default (0: never; see
// docs/dense-kernels.md for what it measured).
constexpr int64_t kOnePlaneRowsAtMost = 0;
#if defined(__x86_64__)
using vllm_xla::int4::Avx2Int4;
using vllm_xla::int4::AmxInt4;
using vllm_xla::int4::Avx512Bf16Int4;
using vllm_xla::int4::Avx512FloatInt4;
#endif

using vllm_xla::WidenHalves;

// The scales and offsets as the paths read them: float32 as given, or float16 bits, which
// "avx512_vnni" and "avx512_bf16" read as they are and every other path as float32 widened once a
// call (exact; those paths are for CPUs without AVX-512 VNNI or BF16).
struct GroupScales {
  const float* scale = nullptr;
  const float* offset = nullptr;  // null: none
  const uint16_t* half_scale = nullptr;  // float16 bits (then `scale` and `offset` come from `Widen`)
  const uint16_t* half_offset = nullptr;
  float scale_in_base = -8.0f;  // a group's base is offset + scale_in_base * s (0: the offsets are bases)
  int64_t count = 0;
  std::vector<float> wide_scale, wide_offset;

  // `first`: the elements of the scales (and offsets) before the layer's, `layer_count` its own.
  GroupScales(const ffi::AnyBuffer& s, const ffi::AnyBuffer& m, bool bases, int64_t first, int64_t layer_count)
      : count(layer_count) {
    scale_in_base = bases ? 0.0f : -8.0f;
    const bool given = m.element_count() > 0;
    if (s.element_type() == ffi::DataType::F16) {
      half_scale = reinterpret_cast<const uint16_t*>(s.untyped_data()) + first;
      half_offset = given ? reinterpret_cast<const uint16_t*>(m.untyped_data()) + first : nullptr;
      return;
    }
    scale = reinterpret_cast<const float*>(s.untyped_data()) + first;
    offset = given ? reinterpret_cast<const float*>(m.untyped_data()) + first : nullptr;
  }
  GroupScales(const GroupScales&) = delete;  // `scale` may point into `wide_scale`

  // Float16 scales and offsets widened to float32 (nothing for float32 ones).
  void Widen() {
    if (half_scale == nullptr || scale != nullptr) return;
    wide_scale.resize(count);
    WidenHalves(half_scale, count, wide_scale.data());
    scale = wide_scale.data();
    if (half_offset == nullptr) return;
    wide_offset.resize(count);
    WidenHalves(half_offset, count, wide_offset.data());
    offset = wide_offset.data();
  }
};


// Whether this process may run the `isa` path, probed once.
bool IsaUsable(Int4Isa isa) {
#if defined(__x86_64__)
  static const bool avx2 = vllm_xla::Avx2Usable(), bf16 = avx2 && vllm_xla::Avx512Bf16Usable(),
                    vnni = avx2 && vllm_xla::Avx512VnniUsable(), amx = bf16 && vllm_xla::AmxUsable(),
                    avx512 = avx2 && vllm_xla::Avx512Usable();
  if (isa == kAmx) return amx;
  if (isa == kAvx512Float) return avx512;
  if (isa == kAvx2 || isa == kAvx2Float) return avx2;
  if (isa == kAvx512Bf16) return bf16;
  if (isa == kAvx512Vnni) return vnni;
#endif
  return isa == kPortable;
}

// The float product for float32 x: a whole panel line a register where the CPU has AVX-512.
Int4Isa FloatIsa() { return IsaUsable(kAvx512Float) ? kAvx512Float : kAvx2Float; }

// The path an unforced call takes: integer products for bfloat16 x (their 16-bit fixed point is
// finer than x's own rounding; float32 x asks for more, so it keeps the float product), and for
// many rows of it VDPBF16PS where the CPU has it. "avx512_vnni" runs many rows as the next path.
Int4Isa BestIsa(ffi::DataType type) {
  if (!IsaUsable(kAvx2)) return kPortable;
  if (type != ffi::DataType::BF16) return FloatIsa();
  if (IsaUsable(kAvx512Vnni)) return kAvx512Vnni;
  return IsaUsable(kAvx512Bf16) ? kAvx512Bf16 : kAvx2;
}

// The path for many rows of bfloat16 x: AMX tiles where the CPU has them (K a multiple of their
// depth), else VDPBF16PS, else AVX2's integer products.
Int4Isa ManyRowsIsa(int64_t K) {
  if (IsaUsable(kAmx) && K % vllm_xla::kAmxTileDepth == 0) return kAmx;
  return IsaUsable(kAvx512Bf16) ? kAvx512Bf16 : kAvx2;
}

// Whether "avx512_vnni" takes x in one byte plane per block of k (`x_bits` 8) rather than 16-bit
// fixed point per row (16); 0: the default for M rows.
bool OnePlane(int32_t x_bits, int64_t M) { return x_bits == 8 || (x_bits == 0 && M <= kOnePlaneRowsAtMost); }

// x's first M rows as float32 (bfloat16 values are the high halves of float32s).
const float* FloatRows(const ffi::AnyBuffer& x, int64_t M, int64_t K, std::vector<float>& wide) {
  if (x.element_type() == ffi::DataType::F32) return reinterpret_cast<const float*>(x.untyped_data());
  wide.resize(M * K);
  const auto* bits = reinterpret_cast<const uint16_t*>(x.untyped_data());
  for (int64_t i = 0; i < M * K; ++i) {
    const uint32_t value = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(&wide[i], &value, sizeof(value));
  }
  return wide.data();
}

// Groups whose sums `GroupSums` adds side by side: one group's adds are a chain (each waits for the
// last), and a group at a time made this serial step, before the threads start, grow with the rows.
constexpr int64_t kSideBySideGroups = 16;

// Each row's sums of x over its groups of `group` k: [M, K / group], each group's k added in order.
std::vector<float> GroupSums(const float* x, int64_t M, int64_t K, int64_t group) {
  const int64_t count = M * (K / group);  // the groups of all rows, x + g * group each
  std::vector<float> sums(count, 0.0f);
  int64_t g = 0;
  for (; g + kSideBySideGroups <= count; g += kSideBySideGroups) {
    float chain[kSideBySideGroups] = {};
    for (int64_t k = 0; k < group; ++k) {
      for (int64_t j = 0; j < kSideBySideGroups; ++j) chain[j] += x[(g + j) * group + k];
    }
    std::copy(chain, chain + kSideBySideGroups, sums.begin() + g);
  }
  for (; g < count; ++g) {
    for (int64_t k = g * group; k < (g + 1) * group; ++k) sums[g] += x[k];
  }
  return sums;
}

// max |row| (exact in any order: 16 maxima side by side).
float Largest(const float* row, int64_t K) {
  float lanes[kSideBySideGroups] = {};
  int64_t k = 0;
  for (; k + kSideBySideGroups <= K; k += kSideBySideGroups) {
    for (int64_t j = 0; j < kSideBySideGroups; ++j) lanes[j] = std::max(lanes[j], std::fabs(row[k + j]));
  }
  for (; k < K; ++k) lanes[0] = std::max(lanes[0], std::fabs(row[k]));
  return *std::max_element(lanes, lanes + kSideBySideGroups);
}

// Each row's group sums over its fixed-point step sx (`FixedPointRows::inverse`'s rounding), 0 for
// a row of zeros.
std::vector<float> SumsOverStep(const float* x, std::vector<float> sums, int64_t M, int64_t K) {
  const int64_t groups = static_cast<int64_t>(sums.size()) / M;
  for (int64_t r = 0; r < M; ++r) {
    const float largest = Largest(x + r * K, K);
    const float inverse = largest > 0.0f ? kFixedLevels / largest : 0.0f;
    for (int64_t g = 0; g < groups; ++g) sums[r * groups + g] *= inverse;
  }
  return sums;
}

// The rows of x before its trailing zero rows (`RowsBeforeZeroTail`).
int64_t RowsToMultiply(const ffi::AnyBuffer& x, int64_t rows, int64_t K) {
  if (x.element_type() == ffi::DataType::BF16) {
    return vllm_xla::RowsBeforeZeroTail<uint16_t>(reinterpret_cast<const uint16_t*>(x.untyped_data()), rows, K,
                                                  0x7fff);
  }
  return vllm_xla::RowsBeforeZeroTail<uint32_t>(reinterpret_cast<const uint32_t*>(x.untyped_data()), rows, K,
                                                0x7fffffffu);
}

// Whether the scales are float32 or float16 and the offsets none or of the scales' shape and type.
bool ScalesFit(const ffi::AnyBuffer& scale, const ffi::AnyBuffer& offset) {
  const auto sd = scale.dimensions();
  const auto type = scale.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::F16) return false;
  return offset.element_count() == 0 ||
         (offset.element_type() == type && offset.dimensions().size() == sd.size() &&
          std::equal(sd.begin(), sd.end(), offset.dimensions().begin()));
}

#if defined(__x86_64__)
// Runs an "avx512_vnni" path (`Problem`: `VnniInt4` on `FixedPointRows`, `VnniInt4Q8` on
// `BlockInt8Rows`) with the scales as given: float16 bits read as they are, or float32.
template <template <typename> class Problem, typename Rows>
void RunVnni(const Rows& rows, const GroupScales& scales, const uint32_t* w, const float* x_sums, float* y, int64_t M,
             int64_t K, int64_t N, int64_t group, int64_t max_blocks, ffi::ThreadPool& pool) {
  if (scales.half_scale != nullptr) {
    const Problem<uint16_t> problem{&rows, w, scales.half_scale, scales.half_offset, x_sums, y, M, K, N, group,
                                    scales.scale_in_base};
    vllm_xla::RunOverColumnBlocks(problem, N / kCols, max_blocks, pool);
    return;
  }
  const Problem<float> problem{&rows, w, scales.scale, scales.offset, x_sums, y, M, K, N, group,
                               scales.scale_in_base};
  vllm_xla::RunOverColumnBlocks(problem, N / kCols, max_blocks, pool);
}
#endif

ffi::Error DenseInt4(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> w, ffi::AnyBuffer scale,
                     ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y, int32_t isa, int32_t bases,
                     int32_t x_bits, int32_t layer) {
  const auto xd = x.dimensions();
  const bool stacked = w.dimensions().size() == 4;  // then the scales and offsets (if any) are stacks too
  const auto weight = vllm_xla::LayerOf(w.dimensions(), stacked, layer);
  const auto scales_of_layer = vllm_xla::LayerOf(scale.dimensions(), stacked, layer);
  const auto wd = weight.dims;
  const auto sd = scales_of_layer.dims;
  const auto type = x.element_type();
  const bool shapes_fit = weight.ok && scales_of_layer.ok && xd.size() == 2 && wd.size() == 3 && wd[2] == kCols && wd[1] * kWordDepth == xd[1] &&
                          (sd.size() == 1 || sd.size() == 2) && sd.back() == wd[0] * kCols;
  const int64_t groups = shapes_fit && sd.size() == 2 ? sd[0] : 1;
  const bool groups_fit = shapes_fit && groups > 0 && xd[1] % groups == 0 && xd[1] / groups % kWordDepth == 0;
  if (!groups_fit || !ScalesFit(scale, offset) || (type != ffi::DataType::BF16 && type != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K] (bfloat16 or float32), a packed int4 weight [N/16, K/8, 16] (uint32), float32 or "
        "float16 scales [N] or [K/G, N] with G a multiple of 8, and offsets of the scales' shape and type or none "
        "(or stacks of each holding `layer`)");
  }
  Int4Isa run = isa == kBestIsa ? BestIsa(type) : static_cast<Int4Isa>(isa);
  if (!IsaUsable(run)) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "this CPU or kernel does not allow the requested int4 dense path (AVX2 with FMA)");
  }
  const int64_t K = xd[1], N = wd[0] * kCols, group = K / groups;
  const int64_t M = RowsToMultiply(x, xd[0], K);
  std::memset(y->typed_data() + M * N, 0, sizeof(float) * (xd[0] - M) * N);
  if (M == 0) return ffi::Error::Success();
  if (run == kAvx512Vnni && (type != ffi::DataType::BF16 || M > kVnniRowsAtMost)) {
    run = type != ffi::DataType::BF16 ? FloatIsa() : ManyRowsIsa(K);
  }
  if (run == kAmx && K % vllm_xla::kAmxTileDepth != 0) run = kAvx512Bf16;  // AMX tiles are 32 k deep
  if ((run == kAvx512Bf16 || run == kAmx) && (type != ffi::DataType::BF16 || M <= kWidenAheadAbove)) {
    run = type == ffi::DataType::BF16 ? kAvx2 : FloatIsa();  // a few rows: unpacked in registers
  }
  GroupScales scales(scale, offset, bases != 0, scales_of_layer.offset, groups * N);
  const uint32_t* w_words = w.typed_data() + weight.offset;
  if (run != kAvx512Vnni && run != kAvx512Bf16 && run != kAmx) scales.Widen();  // those read float16 as it is
#if defined(__x86_64__)
  if (run == kAmx) {  // x as it is, its rows padded to whole tiles
    std::vector<uint16_t> padded;
    int64_t Mp = M;
    const uint16_t* x_rows =
        vllm_xla::AmxRows(reinterpret_cast<const uint16_t*>(x.untyped_data()), M, K, padded, Mp);
    const Int4Problem operands{nullptr, w_words, scales.scale, scales.offset, nullptr, y->typed_data(),
                               M,       K,            N,            group,         nullptr, scales.scale_in_base};
    const AmxInt4 tiles{operands, x_rows, Mp, scales.half_scale, scales.half_offset};
    const int64_t cached = vllm_xla::CachedBlocks(K, sizeof(uint16_t));  // in L2 as bfloat16
    vllm_xla::RunOverColumnBlocks(tiles, N / kCols, std::max<int64_t>(2, cached), pool);
    return ffi::Error::Success();
  }
  if (run == kAvx512Bf16) {  // x as it is: neither float32 rows nor their group sums
    const Int4Problem operands{nullptr, w_words, scales.scale, scales.offset, nullptr, y->typed_data(),
                               M,       K,            N,            group,         nullptr, scales.scale_in_base};
    const Avx512Bf16Int4 widened{operands, reinterpret_cast<const uint16_t*>(x.untyped_data()), scales.half_scale,
                                 scales.half_offset};
    const int64_t cached = vllm_xla::CachedBlocks(K, sizeof(uint16_t));  // in L2 as bfloat16
    vllm_xla::RunOverColumnBlocks(widened, N / kCols, std::max<int64_t>(vllm_xla::kBf16VectorBlocks, cached), pool);
    return ffi::Error::Success();
  }
#endif
  std::vector<float> wide;
  const float* rows = FloatRows(x, M, K, wide);
  const std::vector<float> sums = GroupSums(rows, M, K, group);
  const int64_t max_blocks = std::max<int64_t>(2, vllm_xla::CachedBlocks(K, sizeof(float)));
#if defined(__x86_64__)
  if (run == kAvx512Vnni && OnePlane(x_bits, M)) {
    vllm_xla::BlockInt8Rows blocks;
    if (blocks.Quantize(reinterpret_cast<const uint16_t*>(x.untyped_data()), M, K, group)) {
      RunVnni<vllm_xla::VnniInt4Q8>(blocks, scales, w_words, sums.data(), y->typed_data(), M, K, N, group,
                                    max_blocks, pool);
      return ffi::Error::Success();
    }  // a block of tiny values, or one not finite: the two planes below (or the float product)
  }
  if (run == kAvx512Vnni) {
    vllm_xla::FixedPointRows planes;
    if (planes.Quantize(reinterpret_cast<const uint16_t*>(x.untyped_data()), M, K, K)) {
      const std::vector<float> scaled = SumsOverStep(rows, sums, M, K);
      RunVnni<vllm_xla::VnniInt4>(planes, scales, w_words, scaled.data(), y->typed_data(), M, K, N, group,
                                  max_blocks, pool);
      return ffi::Error::Success();
    }
    run = kAvx2;  // what the fixed point cannot hold: "avx2" leaves it to the float product
  }
#endif
  scales.Widen();
  FixedPointRows fixed;
  // Not finite values (the float product carries them as it would) or rows too small for the fixed
  // point: the float path.
  const bool integer = run == kAvx2 && M <= kWidenAheadAbove && fixed.Quantize(rows, M, K);
  const Int4Problem problem{rows, w_words, scales.scale, scales.offset, sums.data(), y->typed_data(),
                            M,    K,            N,            group,         integer ? &fixed : nullptr,
                            scales.scale_in_base};
#if defined(__x86_64__)
  if (run == kAvx512Float) {
    vllm_xla::RunOverColumnBlocks(Avx512FloatInt4{Avx2Int4{problem}}, N / kCols, max_blocks, pool);
    return ffi::Error::Success();
  }
  if (run == kAvx2 || run == kAvx2Float) {
    vllm_xla::RunOverColumnBlocks(Avx2Int4{problem}, N / kCols, max_blocks, pool);
    return ffi::Error::Success();
  }
#endif
  vllm_xla::RunOverColumnBlocks(PortableInt4{problem}, N / kCols, max_blocks, pool);
  return ffi::Error::Success();
}

}  // namespace

// The int4 dense paths this process may run, as a bit mask: bit 1 AVX2 (integer products), bit 2
// portable, bit 3 AVX2 (float products), bit 4 AVX-512 BF16 (widened panels for many rows), bit 5
// AVX-512 VNNI (integer products for a few rows), bit 6 AMX (widened panels for many rows), bit 7
// AVX-512 (float products).
extern "C" int VllmXlaDenseInt4Isas() {
  return (IsaUsable(kAvx2) ? 1 << kAvx2 : 0) | (IsaUsable(kPortable) ? 1 << kPortable : 0) |
         (IsaUsable(kAvx2Float) ? 1 << kAvx2Float : 0) | (IsaUsable(kAvx512Bf16) ? 1 << kAvx512Bf16 : 0) |
         (IsaUsable(kAvx512Vnni) ? 1 << kAvx512Vnni : 0) | (IsaUsable(kAmx) ? 1 << kAmx : 0) |
         (IsaUsable(kAvx512Float) ? 1 << kAvx512Float : 0);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaDenseInt4, DenseInt4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("bases")
                                  .Attr<int32_t>("x_bits")
                                  .Attr<int32_t>("layer"));
