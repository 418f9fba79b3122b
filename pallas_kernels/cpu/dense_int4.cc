// SPDX-License-Identifier: Apache-2.0
// 4-bit-weight dense layers (W4A16) as an XLA FFI handler: y[M, N] (float32) = x[M, K] @ w with
// w = q * s + m, q int4 in [-8, 7] packed two a byte, s a float32 scale per group of G consecutive
// k and column (scale [K/G, N]; G = K: one per column, scale [N]) and m an optional float32 offset
// of the scale's layout (affine 4-bit: zero points, GGUF Q4_1's block minimums). x is bfloat16 or
// float32.
//
// Decode streams every weight once a step, so its speed is the weights' bytes: half of int8's, a
// quarter of bfloat16's. The values are never dequantized to memory: each group's products
// x . q accumulate in float32 from nibbles widened in registers (every int4 value is exact in
// float32), then fold into the output as sum_g s_g (x_g . q_g) + m_g (sum of x_g), the offsets'
// part from each row's sums of x over the groups (computed once per call). That is the product of
// the float weights up to float32 rounding, and exactly the sum `models.int4` defines.
//
// The weight is packed once into [N/16, K/8, 16] uint32 (`pack_dense_kernel_int4` in
// dense_int4.py): each 16-column panel is K/8 contiguous 64-byte lines, and each 32-bit word holds
// one column's eight consecutive k as two's-complement nibbles, the first in the lowest bits. A
// nibble widens with two shifts (left to the top, arithmetic right by 28) and one convert, in the
// lane of its column, with no byte shuffles; the eight k of a line meet eight broadcast values of
// x. K must be a multiple of 8 and N of 16, G a multiple of 8 that divides K.
//
// Work items are runs of 16-column blocks (`RunOverColumnBlocks`). Up to `kWidenAheadAbove` rows
// they are walked in register blocks of up to 3 rows (AVX2) with the nibbles widened in registers
// as they stream; for more rows each panel is dequantized once per chunk of rows to float32
// [K, 16] (q * s + m) and the rows run on the float32 kernel's 6x16 register blocks, which then
// do nothing but FMAs. A portable path (plain C++, vectorized by the compiler) computes the same
// sums on any CPU.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "dense_f32_block.h"
#endif

#include "dense_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The `isa` attribute: which path runs (the codes of `DENSE_INT4_ISAS` in build.py).
enum Int4Isa : int32_t { kBestIsa = 0, kAvx2 = 1, kPortable = 2 };

using vllm_xla::Item;
using vllm_xla::WalkRegisterBlocks;

constexpr int64_t kCols = 16;  // columns of a packed panel
constexpr int64_t kWordDepth = 8;  // k in a packed word
constexpr int kRows = 3;  // rows of x in an AVX2 register block: 2 x 2 x 3 accumulators and totals
// Above this many rows each panel is dequantized once per chunk of rows, then multiplied with the
// float32 kernel's register blocks (at a few rows widening in registers costs less than writing
// and rereading the float32 panel).
constexpr int64_t kWidenAheadAbove = 8;

// The k-th value (0 to 7) of a packed word, sign-extended.
inline int32_t Nibble(uint32_t word, int k) { return static_cast<int32_t>(word << (28 - 4 * k)) >> 28; }

struct Int4Problem {
  const float* x;       // [M, K]
  const uint32_t* w;    // [N/16, K/8, 16]
  const float* scale;   // [K / group, N]
  const float* offset;  // [K / group, N], or null
  const float* x_sums;  // [M, K / group]: each row's sum over each group of k, or null
  float* y;             // [M, N]
  int64_t M, K, N;
  int64_t group;        // k that share a scale: K, or a multiple of 8 that divides K

  static void Begin() {}
  static void End() {}

  int64_t Groups() const { return K / group; }

  // y[row : row + rows, block * 16 : block * 16 + 16] in plain C++.
  void PortableBlock(int64_t row, int rows, int64_t block) const {
    const int64_t words = K / kWordDepth, group_words = group / kWordDepth;
    const uint32_t* panel = w + block * words * kCols;
    for (int64_t r = row; r < row + rows; ++r) {
      const float* xr = x + r * K;
      float total[kCols] = {};
      for (int64_t g = 0; g < Groups(); ++g) {
        float acc[kCols] = {};
        for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
          const uint32_t* line = panel + word * kCols;
          for (int k = 0; k < kWordDepth; ++k) {
            const float xk = xr[word * kWordDepth + k];
            for (int c = 0; c < kCols; ++c) acc[c] += xk * static_cast<float>(Nibble(line[c], k));
          }
        }
        const float* s = scale + g * N + block * kCols;
        for (int c = 0; c < kCols; ++c) total[c] += acc[c] * s[c];
        if (offset != nullptr) {
          const float* m = offset + g * N + block * kCols;
          const float sum = x_sums[r * Groups() + g];
          for (int c = 0; c < kCols; ++c) total[c] += sum * m[c];
        }
      }
      std::memcpy(y + r * N + block * kCols, total, sizeof(total));
    }
  }

#if defined(__x86_64__)
#define VLLM_XLA_INT4_AVX2 __attribute__((target("avx2,fma")))
// Register blocks unroll whole: an accumulator array indexed in a loop would live in memory, and
// a nibble's shifts need their counts as immediates.
#define VLLM_XLA_UNROLL_INT4 _Pragma("GCC unroll 16")

  // The k-th nibble (0 to 7) of each 32-bit lane, sign-extended, as float32.
  VLLM_XLA_INT4_AVX2 static inline __m256 Widen(__m256i words, int k) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 28 - 4 * k), 28));
  }

  // y[row : row + R, block * 16 : block * 16 + 16] with AVX2: each group's products accumulate
  // apart (two chains per 8-column half for one row, so enough FMAs run at once), then fold into
  // the totals times the group's scales, plus the row's sum over the group times its offsets.
  template <int R>
  VLLM_XLA_INT4_AVX2 static void Avx2Block(const Int4Problem& p, int64_t row, int64_t block) {
    constexpr int kChains = R == 1 ? 2 : 1;
    const int64_t words = p.K / kWordDepth, group_words = p.group / kWordDepth, groups = p.Groups();
    const uint32_t* panel = p.w + block * words * kCols;
    const float* x = p.x + row * p.K;
    __m256 total[R][2];
    VLLM_XLA_UNROLL_INT4
    for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[R][2][kChains];
      VLLM_XLA_UNROLL_INT4
      for (int r = 0; r < R; ++r)
        VLLM_XLA_UNROLL_INT4
        for (int h = 0; h < 2; ++h)
          VLLM_XLA_UNROLL_INT4
          for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm256_setzero_ps();
      for (int64_t word = g * group_words; word < (g + 1) * group_words; ++word) {
        const uint32_t* line = panel + word * kCols;
        const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 8));
        const float* xk = x + word * kWordDepth;
        VLLM_XLA_UNROLL_INT4
        for (int k = 0; k < kWordDepth; ++k) {
          const __m256 wl = Widen(low, k), wh = Widen(high, k);
          VLLM_XLA_UNROLL_INT4
          for (int r = 0; r < R; ++r) {
            const __m256 xs = _mm256_set1_ps(xk[r * p.K + k]);
            acc[r][0][k % kChains] = _mm256_fmadd_ps(wl, xs, acc[r][0][k % kChains]);
            acc[r][1][k % kChains] = _mm256_fmadd_ps(wh, xs, acc[r][1][k % kChains]);
          }
        }
      }
      VLLM_XLA_UNROLL_INT4
      for (int h = 0; h < 2; ++h) {
        const int64_t at = g * p.N + block * kCols + h * 8;
        const __m256 s = _mm256_loadu_ps(p.scale + at);
        const __m256 m = p.offset != nullptr ? _mm256_loadu_ps(p.offset + at) : _mm256_setzero_ps();
        VLLM_XLA_UNROLL_INT4
        for (int r = 0; r < R; ++r) {
          __m256 sum = acc[r][h][0];
          if constexpr (kChains == 2) sum = _mm256_add_ps(sum, acc[r][h][1]);
          total[r][h] = _mm256_fmadd_ps(sum, s, total[r][h]);
          if (p.offset != nullptr) {
            total[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(p.x_sums[(row + r) * groups + g]), m, total[r][h]);
          }
        }
      }
    }
    VLLM_XLA_UNROLL_INT4
    for (int r = 0; r < R; ++r)
      VLLM_XLA_UNROLL_INT4
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(p.y + (row + r) * p.N + block * kCols + h * 8, total[r][h]);
  }

  // One packed panel -> its float32 weights [K, 16], q * s + m (the float32 block's layout).
  VLLM_XLA_INT4_AVX2 void DequantizePanel(int64_t block, float* to) const {
    const int64_t words = K / kWordDepth, group_words = group / kWordDepth;
    const uint32_t* panel = w + block * words * kCols;
    for (int64_t word = 0; word < words; ++word) {
      const int64_t at = word / group_words * N + block * kCols;
      VLLM_XLA_UNROLL_INT4
      for (int h = 0; h < 2; ++h) {
        const __m256i words8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + word * kCols + h * 8));
        const __m256 s = _mm256_loadu_ps(scale + at + h * 8);
        const __m256 m = offset != nullptr ? _mm256_loadu_ps(offset + at + h * 8) : _mm256_setzero_ps();
        VLLM_XLA_UNROLL_INT4
        for (int k = 0; k < kWordDepth; ++k) {
          _mm256_storeu_ps(to + (word * kWordDepth + k) * kCols + h * 8, _mm256_fmadd_ps(Widen(words8, k), s, m));
        }
      }
    }
  }

  using BlockKernel = void (*)(const Int4Problem&, int64_t, int64_t);
  static constexpr BlockKernel kAvx2Kernels[kRows] = {&Avx2Block<1>, &Avx2Block<2>, &Avx2Block<3>};
#undef VLLM_XLA_UNROLL_INT4
#undef VLLM_XLA_INT4_AVX2
#endif  // __x86_64__
};

struct PortableInt4 : Int4Problem {
  void Run(const Item& item) const {
    WalkRegisterBlocks(item, M, K * sizeof(float), kRows, 1,
                       [&](int64_t row, int rows, int64_t block, int) { PortableBlock(row, rows, block); });
  }
};

#if defined(__x86_64__)
struct Avx2Int4 : Int4Problem {
  void Run(const Item& item) const {
    if (M > kWidenAheadAbove) return RunWidened(item);
    WalkRegisterBlocks(item, M, K * sizeof(float), kRows, 1,
                       [&](int64_t row, int rows, int64_t block, int) { kAvx2Kernels[rows - 1](*this, row, block); });
  }

  // Many rows: each column panel dequantized to float32 once per chunk of rows.
  void RunWidened(const Item& item) const {
    std::vector<float> panel(K * kCols);
    int64_t widened = -1;  // the column block `panel` holds
    WalkRegisterBlocks(item, M, K * sizeof(float), vllm_xla::kF32BlockRows, 1,
                       [&](int64_t row, int rows, int64_t block, int) {
                         if (block != widened) {
                           DequantizePanel(block, panel.data());
                           widened = block;
                         }
                         vllm_xla::F32BlockFor(rows)(x + row * K, panel.data(), K, y + row * N + block * kCols, N);
                       });
  }
};
#endif

// Whether this process may run the `isa` path, probed once.
bool IsaUsable(Int4Isa isa) {
#if defined(__x86_64__)
  static const bool avx2 = vllm_xla::Avx2Usable();
  if (isa == kAvx2) return avx2;
#endif
  return isa == kPortable;
}

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

// Each row's sums of x over its groups of `group` k: [M, K / group].
std::vector<float> GroupSums(const float* x, int64_t M, int64_t K, int64_t group) {
  std::vector<float> sums(M * (K / group), 0.0f);
  for (int64_t i = 0; i < M * K; ++i) sums[i / group] += x[i];
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

ffi::Error DenseInt4(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> w, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y, int32_t isa) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scale.dimensions();
  const auto type = x.element_type();
  const bool shapes_fit = xd.size() == 2 && wd.size() == 3 && wd[2] == kCols && wd[1] * kWordDepth == xd[1] &&
                          (sd.size() == 1 || sd.size() == 2) && sd.back() == wd[0] * kCols;
  const int64_t groups = shapes_fit && sd.size() == 2 ? sd[0] : 1;
  const bool groups_fit = shapes_fit && groups > 0 && xd[1] % groups == 0 && xd[1] / groups % kWordDepth == 0;
  const bool offset_fits = offset.element_count() == 0 || (offset.dimensions().size() == sd.size() &&
                                                           std::equal(sd.begin(), sd.end(), offset.dimensions().begin()));
  if (!groups_fit || !offset_fits || (type != ffi::DataType::BF16 && type != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K] (bfloat16 or float32), a packed int4 weight [N/16, K/8, 16] (uint32), float32 scales "
        "[N] or [K/G, N] with G a multiple of 8, and offsets of the scales' shape or none");
  }
  const Int4Isa run = isa == kBestIsa ? (IsaUsable(kAvx2) ? kAvx2 : kPortable) : static_cast<Int4Isa>(isa);
  if (!IsaUsable(run)) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "this CPU or kernel does not allow the requested int4 dense path (AVX2 with FMA)");
  }
  const int64_t K = xd[1], N = wd[0] * kCols, group = K / groups;
  const int64_t M = RowsToMultiply(x, xd[0], K);
  std::memset(y->typed_data() + M * N, 0, sizeof(float) * (xd[0] - M) * N);
  if (M == 0) return ffi::Error::Success();
  std::vector<float> wide;
  const float* rows = FloatRows(x, M, K, wide);
  const bool affine = offset.element_count() > 0;
  const std::vector<float> sums = affine ? GroupSums(rows, M, K, group) : std::vector<float>();
  const Int4Problem problem{rows, w.typed_data(), scale.typed_data(), affine ? offset.typed_data() : nullptr,
                            affine ? sums.data() : nullptr, y->typed_data(), M, K, N, group};
  const int64_t max_blocks = std::max<int64_t>(2, vllm_xla::CachedBlocks(K, sizeof(float)));
#if defined(__x86_64__)
  if (run == kAvx2) {
    vllm_xla::RunOverColumnBlocks(Avx2Int4{problem}, N / kCols, max_blocks, pool);
    return ffi::Error::Success();
  }
#endif
  vllm_xla::RunOverColumnBlocks(PortableInt4{problem}, N / kCols, max_blocks, pool);
  return ffi::Error::Success();
}

}  // namespace

// The int4 dense paths this process may run, as a bit mask: bit 1 AVX2, bit 2 portable.
extern "C" int VllmXlaDenseInt4Isas() {
  return (IsaUsable(kAvx2) ? 1 << kAvx2 : 0) | (IsaUsable(kPortable) ? 1 << kPortable : 0);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaDenseInt4, DenseInt4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa"));
