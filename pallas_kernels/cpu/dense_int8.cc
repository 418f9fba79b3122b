// SPDX-License-Identifier: Apache-2.0
// int8-weight dense layers (W8A16) as an XLA FFI handler: y[M, N] (float32) = (x[M, K] @ q) * s,
// q int8 with one float32 scale per output column (or per group of G consecutive k and column,
// scale [K/G, N]), x bfloat16 or float32. The scales may be float16 instead (GGUF Q8_0's d): the
// VNNI path reads them as they are, the others widen them once a call; either way the result is
// bit for bit what float32 copies of the same values give.
//
// Decode streams every weight once a step and does little else, so its speed is the weights'
// bytes over the memory bandwidth: int8 halves bfloat16's bytes. XLA:CPU converts an int8 kernel
// to a bfloat16 copy in memory before its dot, which costs more than the bytes saved; here the
// int8 values widen to float32 in registers (sign-extend, convert) as they stream and meet x in
// float32 FMAs, and the scale multiplies each output once, at the store. Every int8 value is exact
// in float32 and the products accumulate in float32, so the result is the float product of x and
// q, rounded only by the accumulation.
//
// The weight is packed once into [N/16, K, 16] int8 (`pack_dense_kernel_int8` in dense_int8.py):
// each 16-column panel is K contiguous 16-byte rows, read in order; one row is the 16 lanes of an
// AVX-512 vector (or two AVX2 vectors) after widening. N must be a multiple of 16, K is free.
// x is widened to float32 once per call (its rows are few next to the weights' bytes).
//
// Work items are runs of 16-column blocks (two per thread, `RunOverColumnBlocks`), walked in
// register blocks of up to 6 rows by 4 column blocks (AVX-512) or 6 rows by one (AVX2). Widening
// in registers costs two instructions per 16 weights per register block of rows; from a few rows
// of bfloat16 x on AVX-512 BF16 each panel is instead widened once to bfloat16 pairs, and the
// rows run on the bfloat16 kernel's VDPBF16PS blocks (dense_avx512_bf16.h), which take two
// products an instruction.
//
// With AVX-512 VNNI (and VBMI), bfloat16 x takes integer products instead (dense_int8_vnni.h): x
// rounded per row to 16-bit fixed point, two signed byte planes against the weights' bytes with
// VPDPBUSD (64 byte products an instruction, two per 16-bit product), exact in int32. Per weight
// that is about a third of the widening path's instructions at one row (a permutation, an offset
// and two VPDPBUSD per 64 weights against 16 loads, conversions and FMAs), so a decode step comes
// near the weights' bytes; with many rows it keeps pace with VDPBF16PS on panels widened ahead, without
// widening them, so it serves every row count. The price is x's rounding to 16 bits (below its
// bfloat16 rounding), so float32 x keeps the float product unless the path is asked for.
//
// With AMX bfloat16 tiles, more than 16 rows of bfloat16 x (K a multiple of 32) take "amx" by
// default: each panel widened once to bfloat16 pairs and every row multiplied on the bfloat16
// kernel's tiles (dense_amx.h), several times VPDPBUSD's throughput at those rows. With scales per
// column the pairs are exact and the result the float product of x and q; with scales per group
// they hold q s rounded to bfloat16 (`AmxScaledInt8`).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "dense_amx.h"
#include "dense_avx512_bf16.h"
#include "dense_blocks.h"
#include "dense_int8_vnni.h"
#include "float16.h"
#include "layer_stack.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The `isa` attribute: which path runs (the codes of `DENSE_INT8_ISAS` in build.py).
enum Int8Isa : int32_t { kBestIsa = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAvx2 = 3, kAvx512Vnni = 4, kAmx = 5 };

#if defined(__x86_64__)
using vllm_xla::Item;
using vllm_xla::WalkRegisterBlocks;

constexpr int64_t kCols = 16;  // columns of a packed panel
constexpr int kRows = 6;       // rows of x in a register block
constexpr int kAvx512Blocks = 4;  // 16-column blocks in an AVX-512 register block: 24 accumulators

#define VLLM_XLA_INT8_AVX512 __attribute__((target("avx512f")))
#define VLLM_XLA_INT8_AVX2 __attribute__((target("avx2,fma")))

// Above this many rows of bfloat16 x, the AVX-512 BF16 path widens each int8 panel once to
// bfloat16 pairs and multiplies with VDPBF16PS (two products an instruction, no widening per row
// block); at fewer rows the weights stream from memory and widen in registers (`Avx512Block`).
// Widening a panel to memory costs about as much as multiplying it with a few rows, so the
// register path stays ahead up to two of its row blocks (measured at the 135M model's shapes).
constexpr int64_t kWidenAheadAbove = 8;

struct Int8Problem {
  const float* x;      // [M, K]
  const int8_t* w;     // [N/16, K, 16]
  const float* scale;  // [N], or [K / group, N]
  float* y;            // [M, N]
  int64_t M, K, N;
  int64_t group;       // k that share a scale: K, or a multiple of 4 that divides K

  static void Begin() {}
  static void End() {}

  // y[row : row + R, block * 16 : (block + C) * 16] with AVX-512: each 16-byte panel row widens
  // to one vector of 16 float32 columns. With one row, even and odd k accumulate apart, so enough
  // FMA chains run at once. `Grouped`: a scale per group of k, applied to the widened weights.
  template <int R, int C, bool Grouped>
  VLLM_XLA_INT8_AVX512 static void Avx512Block(const Int8Problem& p, int64_t row, int64_t block) {
    constexpr int kChains = R == 1 ? 2 : 1;
    const int64_t panel = p.K * kCols;
    const int8_t* w = p.w + block * panel;
    const float* x = p.x + row * p.K;
    __m512 acc[R][C][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < kChains; ++h) acc[r][c][h] = _mm512_setzero_ps();
    __m512 group_scale[C];
    int64_t next_group = 0;  // grouped: the k whose group's scales load next
    const int64_t steps = p.K / kChains * kChains;
    for (int64_t k = 0; k < steps; k += kChains) {
      if (Grouped && k == next_group) {
        for (int c = 0; c < C; ++c) group_scale[c] = _mm512_loadu_ps(p.scale + k / p.group * p.N + (block + c) * kCols);
        next_group += p.group;
      }
      for (int h = 0; h < kChains; ++h) {
        __m512 weights[C];
        for (int c = 0; c < C; ++c) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * panel + (k + h) * kCols));
          weights[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
          if constexpr (Grouped) weights[c] = _mm512_mul_ps(weights[c], group_scale[c]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xs = _mm512_set1_ps(x[r * p.K + k + h]);
          for (int c = 0; c < C; ++c) acc[r][c][h] = _mm512_fmadd_ps(weights[c], xs, acc[r][c][h]);
        }
      }
    }
    for (int64_t k = steps; k < p.K; ++k) {  // an odd K's last row (one-row blocks; never grouped)
      for (int c = 0; c < C; ++c) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * panel + k * kCols));
        const __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        for (int r = 0; r < R; ++r) acc[r][c][0] = _mm512_fmadd_ps(weights, _mm512_set1_ps(x[r * p.K + k]), acc[r][c][0]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 s = Grouped ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(p.scale + (block + c) * kCols);
      for (int r = 0; r < R; ++r) {
        __m512 sum = acc[r][c][0];
        if constexpr (kChains == 2) sum = _mm512_add_ps(sum, acc[r][c][1]);
        _mm512_storeu_ps(p.y + (row + r) * p.N + (block + c) * kCols, _mm512_mul_ps(sum, s));
      }
    }
  }

  // The same for one 16-column block with AVX2: a panel row widens to two vectors of 8 columns.
  template <int R, bool Grouped>
  VLLM_XLA_INT8_AVX2 static void Avx2Block(const Int8Problem& p, int64_t row, int64_t block) {
    constexpr int kChains = R <= 2 ? 2 : 1;
    const int8_t* w = p.w + block * p.K * kCols;
    const float* x = p.x + row * p.K;
    __m256 acc[R][2][kChains];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < kChains; ++c) acc[r][h][c] = _mm256_setzero_ps();
    auto widen = [](const int8_t* bytes) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
    };
    __m256 group_low, group_high;
    int64_t next_group = 0;
    const int64_t steps = p.K / kChains * kChains;
    for (int64_t k = 0; k < steps; k += kChains) {
      if (Grouped && k == next_group) {
        group_low = _mm256_loadu_ps(p.scale + k / p.group * p.N + block * kCols);
        group_high = _mm256_loadu_ps(p.scale + k / p.group * p.N + block * kCols + 8);
        next_group += p.group;
      }
      for (int c = 0; c < kChains; ++c) {
        const int8_t* line = w + (k + c) * kCols;
        __m256 low = widen(line), high = widen(line + 8);
        if constexpr (Grouped) low = _mm256_mul_ps(low, group_low), high = _mm256_mul_ps(high, group_high);
        for (int r = 0; r < R; ++r) {
          const __m256 xs = _mm256_set1_ps(x[r * p.K + k + c]);
          acc[r][0][c] = _mm256_fmadd_ps(low, xs, acc[r][0][c]);
          acc[r][1][c] = _mm256_fmadd_ps(high, xs, acc[r][1][c]);
        }
      }
    }
    for (int64_t k = steps; k < p.K; ++k) {
      const int8_t* line = w + k * kCols;
      const __m256 low = widen(line), high = widen(line + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(x[r * p.K + k]);
        acc[r][0][0] = _mm256_fmadd_ps(low, xs, acc[r][0][0]);
        acc[r][1][0] = _mm256_fmadd_ps(high, xs, acc[r][1][0]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        __m256 sum = acc[r][h][0];
        if constexpr (kChains == 2) sum = _mm256_add_ps(sum, acc[r][h][1]);
        const __m256 s = Grouped ? _mm256_set1_ps(1.0f) : _mm256_loadu_ps(p.scale + block * kCols + h * 8);
        _mm256_storeu_ps(p.y + (row + r) * p.N + block * kCols + h * 8, _mm256_mul_ps(sum, s));
      }
    }
  }

  using BlockKernel = void (*)(const Int8Problem&, int64_t, int64_t);
  template <int R, bool G>
  static constexpr BlockKernel kAvx512Row[kAvx512Blocks] = {&Avx512Block<R, 1, G>, &Avx512Block<R, 2, G>,
                                                            &Avx512Block<R, 3, G>, &Avx512Block<R, 4, G>};
  template <bool G>
  static constexpr const BlockKernel* kAvx512Kernels[kRows] = {kAvx512Row<1, G>, kAvx512Row<2, G>,
                                                               kAvx512Row<3, G>, kAvx512Row<4, G>,
                                                               kAvx512Row<5, G>, kAvx512Row<6, G>};
  template <bool G>
  static constexpr BlockKernel kAvx2Kernels[kRows] = {&Avx2Block<1, G>, &Avx2Block<2, G>, &Avx2Block<3, G>,
                                                      &Avx2Block<4, G>, &Avx2Block<5, G>, &Avx2Block<6, G>};
};

struct Avx512Int8 : Int8Problem {
  void Run(const Item& item) const {
    const BlockKernel* const* kernels = group < K ? kAvx512Kernels<true> : kAvx512Kernels<false>;
    WalkRegisterBlocks(item, M, K * sizeof(float), kRows, kAvx512Blocks,
                       [&](int64_t row, int rows, int64_t block, int blocks) {
                         kernels[rows - 1][blocks - 1](*this, row, block);
                       });
  }
};

struct Avx2Int8 : Int8Problem {
  void Run(const Item& item) const {
    const BlockKernel* kernels = group < K ? kAvx2Kernels<true> : kAvx2Kernels<false>;
    WalkRegisterBlocks(item, M, K * sizeof(float), kRows, 1,
                       [&](int64_t row, int rows, int64_t block, int) { kernels[rows - 1](*this, row, block); });
  }
};

// An int8 panel [K, 16] -> bfloat16 pairs [K/2, 16, 2] (`Bf16VectorBlock`'s layout): each int8
// value is exact in bfloat16, the high half of its float32.
// (A function rather than a lambda: a lambda does not inherit the target attribute, so a
// compiler for a CPU without AVX-512 cannot inline the intrinsics into it.)
VLLM_XLA_AVX512BF16 inline __m512i WidenToFloatBits(const int8_t* bytes) {
  return _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)))));
}

VLLM_XLA_AVX512BF16 void WidenPanelToPairs(const int8_t* panel, int64_t K, uint16_t* to) {
  const auto widen = WidenToFloatBits;
  for (int64_t pair = 0; pair < K / 2; ++pair) {
    const __m512i even = widen(panel + 2 * pair * kCols), odd = widen(panel + (2 * pair + 1) * kCols);
    // each 32-bit lane: w[2 pair] in its low half, w[2 pair + 1] in its high half
    const __m512i lanes = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(even, 16), odd);
    _mm512_storeu_si512(to + pair * 2 * kCols, lanes);
  }
}

// y[0 : rows, 0 : 16 blocks] (row stride N) *= the blocks' scales.
VLLM_XLA_AVX512BF16 void ScaleOutputs(float* y, int rows, int blocks, const float* scale, int64_t N) {
  for (int c = 0; c < blocks; ++c) {
    const __m512 s = _mm512_loadu_ps(scale + c * kCols);
    for (int r = 0; r < rows; ++r) {
      float* out = y + r * N + c * kCols;
      _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_loadu_ps(out), s));
    }
  }
}

// Many rows of bfloat16 x on AVX-512 BF16: a work item's column panels widened once to bfloat16
// pairs (the item is sized so that they stay in L2, as the bfloat16 kernel's items are), then the
// bfloat16 kernel's register blocks over every row, then the scales (widening per chunk of rows
// would redo it for every chunk).
struct WidenedInt8 : Int8Problem {
  const uint16_t* x_bits;  // [M, K] bfloat16; K even

  void Run(const Item& item) const {
    const int64_t panel = K * kCols;
    const vllm_xla::AlignedPairs pairs((item.end_block - item.first_block) * panel);
    for (int64_t block = item.first_block; block < item.end_block; ++block) {
      WidenPanelToPairs(w + block * panel, K, pairs.data() + (block - item.first_block) * panel);
    }
    WalkRegisterBlocks(item, M, K * sizeof(uint16_t), vllm_xla::kBf16VectorRows, vllm_xla::kBf16VectorBlocks,
                       [&](int64_t row, int rows, int64_t block, int blocks) {
                         float* out = y + row * N + block * kCols;
                         const uint16_t* widened = pairs.data() + (block - item.first_block) * panel;
                         vllm_xla::Bf16VectorBlockFor(rows, blocks)(x_bits + row * K, widened, panel, K, out, N);
                         ScaleOutputs(out, rows, blocks, scale + block * kCols, N);
                       });
  }
};

// Many rows of bfloat16 x on AMX: as `WidenedInt8`, the item's panels widened once to bfloat16
// pairs (exact), then every row multiplied on AMX tiles (`AmxProduct`, the bfloat16 kernel's),
// then the scales: the float product of x and q.
struct AmxInt8 : Int8Problem {
  const uint16_t* x_bits;  // [Mp, K] bfloat16, rows padded to a multiple of 16 (`AmxRows`)
  int64_t Mp;

  static void Begin() { vllm_xla::AmxBegin(); }
  static void End() { vllm_xla::AmxEnd(); }

  void Run(const Item& item) const {
    const int64_t panel = K * kCols, blocks = item.end_block - item.first_block;
    uint16_t* pairs = vllm_xla::ThreadPairs(blocks * panel);
    for (int64_t block = item.first_block; block < item.end_block; ++block) {
      WidenPanelToPairs(w + block * panel, K, pairs + (block - item.first_block) * panel);
    }
    const vllm_xla::AmxProduct product{x_bits, y, M, Mp, K, N};
    product.Multiply(pairs, item.first_block, item.end_block, /*from_memory=*/false);
    float* out = y + item.first_block * kCols;
    ScaleOutputs(out, static_cast<int>(M), static_cast<int>(blocks), scale + item.first_block * kCols, N);
  }
};

// An int8 panel [K, 16] with a scale per group of `group` k (16 scales a group, `stride` apart:
// float32, or float16 bits) -> q s rounded to bfloat16 pairs [K/2, 16, 2]. `group` is even, so both
// k of a pair share their scales.
template <typename Scale>
VLLM_XLA_AVX512BF16 void WidenScaledPanelToPairs(const int8_t* panel, int64_t K, int64_t group, const Scale* scales,
                                                 int64_t stride, uint16_t* to) {
  for (int64_t g = 0; g < K / group; ++g) {
    const __m512 s = vllm_xla::LoadPanelScales(scales + g * stride);
    for (int64_t pair = g * group / 2; pair < (g + 1) * group / 2; ++pair) {
      const __m512 even = _mm512_mul_ps(_mm512_castsi512_ps(WidenToFloatBits(panel + 2 * pair * kCols)), s);
      const __m512 odd = _mm512_mul_ps(_mm512_castsi512_ps(WidenToFloatBits(panel + (2 * pair + 1) * kCols)), s);
      _mm512_storeu_si512(to + pair * 2 * kCols, vllm_xla::RoundToPairs(even, odd));
    }
  }
}

// Many rows of bfloat16 x with a scale per group of k (GGUF Q8_0's blocks) on AMX: a group's
// scale cannot wait for the output as a column's does, so each panel is widened once to q s
// rounded to bfloat16 pairs (the weights as a bfloat16 checkpoint would hold them, as the int4
// kernel's AMX path widens its blocks), then every row multiplied on AMX tiles. Keeping q exact
// would need each group's 32-deep product stored and scaled apart, a tile store per tile product.
template <typename Scale>
struct AmxScaledInt8 {
  const int8_t* w;       // [N/16, K, 16]
  const Scale* scales;   // [K / group, N]
  const uint16_t* x_bits;  // [Mp, K] bfloat16, rows padded to a multiple of 16 (`AmxRows`)
  float* y;              // [M, N]
  int64_t M, Mp, K, N, group;

  static void Begin() { vllm_xla::AmxBegin(); }
  static void End() { vllm_xla::AmxEnd(); }

  void Run(const Item& item) const {
    const int64_t panel = K * kCols;
    uint16_t* pairs = vllm_xla::ThreadPairs((item.end_block - item.first_block) * panel);
    for (int64_t block = item.first_block; block < item.end_block; ++block) {
      WidenScaledPanelToPairs(w + block * panel, K, group, scales + block * kCols, N,
                              pairs + (block - item.first_block) * panel);
    }
    const vllm_xla::AmxProduct product{x_bits, y, M, Mp, K, N};
    product.Multiply(pairs, item.first_block, item.end_block, /*from_memory=*/false);
  }
};

// Above this many rows, bfloat16 x runs on AMX tiles where the CPU has them (the default's integer
// products up to it: a decode step streams the weights).
constexpr int64_t kAmxAbove = 16;

// Whether this process may run the `isa` path, probed once.
bool IsaUsable(Int8Isa isa) {
  static const bool avx512 = vllm_xla::Avx512Usable(), bf16 = vllm_xla::Avx512Bf16Usable(),
                    avx2 = vllm_xla::Avx2Usable(), vnni = vllm_xla::Avx512VnniUsable(),
                    amx = bf16 && vllm_xla::AmxUsable();
  return (isa == kAmx && amx) || (isa == kAvx512 && avx512) || (isa == kAvx512Bf16 && bf16) || (isa == kAvx2 && avx2) ||
         (isa == kAvx512Vnni && vnni);
}

// The path an unforced call takes: VNNI for bfloat16 x (its 16-bit fixed point is finer than x's
// own bfloat16 rounding; float32 x asks for more, so it keeps the float product), then the rest.
Int8Isa BestIsa(ffi::DataType type) {
  if (type == ffi::DataType::BF16 && IsaUsable(kAvx512Vnni)) return kAvx512Vnni;
  return IsaUsable(kAvx512Bf16) ? kAvx512Bf16 : IsaUsable(kAvx512) ? kAvx512 : kAvx2;
}

// x's first M rows as float32: bfloat16 values are the high halves of float32s.
void WidenRows(const ffi::AnyBuffer& x, int64_t M, int64_t K, std::vector<float>& wide) {
  wide.resize(M * K);
  const auto* bits = reinterpret_cast<const uint16_t*>(x.untyped_data());
  for (int64_t i = 0; i < M * K; ++i) {
    const uint32_t value = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(&wide[i], &value, sizeof(value));
  }
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

// The layer's scales as float32: as given, or float16 ones widened once a call into `wide` (exact;
// the VNNI path reads float16 ones as they are instead).
const float* FloatScales(const ffi::AnyBuffer& scale, int64_t first, int64_t count, std::vector<float>& wide) {
  if (scale.element_type() == ffi::DataType::F32) return reinterpret_cast<const float*>(scale.untyped_data()) + first;
  wide.resize(count);
  vllm_xla::WidenHalves(reinterpret_cast<const uint16_t*>(scale.untyped_data()) + first, count, wide.data());
  return wide.data();
}

ffi::Error DenseInt8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w, ffi::AnyBuffer scale,
                     ffi::ResultBuffer<ffi::F32> y, int32_t isa, int32_t layer) {
  const auto xd = x.dimensions();
  const bool stacked = w.dimensions().size() == 4;
  const auto weight = vllm_xla::LayerOf(w.dimensions(), stacked, layer);
  const auto scales = vllm_xla::LayerOf(scale.dimensions(), stacked, layer);
  const auto wd = weight.dims;
  const auto sd = scales.dims;
  const auto type = x.element_type();
  // Scales [N] (per column) or [K / G, N] (per group of G consecutive k, G a multiple of 4).
  const int64_t groups = sd.size() == 2 ? sd[0] : 1;
  const bool scales_fit = (sd.size() == 1 || sd.size() == 2) && sd.back() == wd[0] * kCols && groups > 0 &&
                          xd.size() == 2 && xd[1] % groups == 0 && (groups == 1 || xd[1] / groups % 4 == 0) &&
                          (scale.element_type() == ffi::DataType::F32 || scale.element_type() == ffi::DataType::F16);
  if (!weight.ok || !scales.ok || xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] != kCols || !scales_fit ||
      (type != ffi::DataType::BF16 && type != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument(
        "expected x [M, K] (bfloat16 or float32), a packed int8 weight [N/16, K, 16] and float32 or float16 "
        "scales [N] or [K/G, N] with G a multiple of 4 (or stacks of weights and scales holding `layer`)");
  }
  Int8Isa run = static_cast<Int8Isa>(isa);
  if (run == kBestIsa) run = BestIsa(type);
  if (!IsaUsable(run)) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "this CPU or kernel does not allow the requested int8 dense path (AVX-512 VNNI with VBMI, "
                      "AVX-512 BF16, AVX-512 or AVX2 with FMA)");
  }
  const int64_t K = xd[1], N = wd[0] * kCols, group = K / groups;
  const int64_t M = RowsToMultiply(x, xd[0], K);
  std::memset(y->typed_data() + M * N, 0, sizeof(float) * (xd[0] - M) * N);
  if (M == 0) return ffi::Error::Success();
  const int8_t* w_values = w.typed_data() + weight.offset;
  const int64_t scale_count = groups * N;
  const int64_t cached_blocks = vllm_xla::CachedBlocks(K, sizeof(int8_t));
  const bool tiles_fit = type == ffi::DataType::BF16 && K % vllm_xla::kAmxTileDepth == 0;
  if (isa == kBestIsa && run == kAvx512Vnni && M > kAmxAbove && tiles_fit && IsaUsable(kAmx)) run = kAmx;
  if (run == kAmx && !(tiles_fit && M > kWidenAheadAbove)) run = kAvx512Bf16;  // as that path runs them
  if (run == kAmx) {
    std::vector<uint16_t> padded;
    int64_t Mp = M;
    const uint16_t* x_rows =
        vllm_xla::AmxRows(reinterpret_cast<const uint16_t*>(x.untyped_data()), M, K, padded, Mp);
    const int64_t widened_blocks = std::max<int64_t>(2, vllm_xla::CachedBlocks(K, sizeof(uint16_t)));  // in L2
    if (groups == 1) {
      std::vector<float> wide_scales;
      const float* s_values = FloatScales(scale, scales.offset, scale_count, wide_scales);
      const AmxInt8 tiles{{nullptr, w_values, s_values, y->typed_data(), M, K, N, K}, x_rows, Mp};
      vllm_xla::RunOverColumnBlocks(tiles, N / kCols, widened_blocks, pool);
      return ffi::Error::Success();
    }
    auto run_scaled = [&](const auto* values) {  // float16 scales read as they are (GGUF's d)
      using Scale = std::remove_const_t<std::remove_pointer_t<decltype(values)>>;
      const AmxScaledInt8<Scale> tiles{w_values, values + scales.offset, x_rows, y->typed_data(), M, Mp, K, N, group};
      vllm_xla::RunOverColumnBlocks(tiles, N / kCols, widened_blocks, pool);
    };
    if (scale.element_type() == ffi::DataType::F16) {
      run_scaled(reinterpret_cast<const uint16_t*>(scale.untyped_data()));
    } else {
      run_scaled(reinterpret_cast<const float*>(scale.untyped_data()));
    }
    return ffi::Error::Success();
  }
  if (run == kAvx512Bf16 && type == ffi::DataType::BF16 && K % 2 == 0 && M > kWidenAheadAbove && groups == 1) {
    std::vector<float> wide_scales;
    const float* s_values = FloatScales(scale, scales.offset, scale_count, wide_scales);
    const WidenedInt8 widened{{nullptr, w_values, s_values, y->typed_data(), M, K, N, K},
                              reinterpret_cast<const uint16_t*>(x.untyped_data())};
    const int64_t widened_blocks = vllm_xla::CachedBlocks(K, sizeof(uint16_t));  // in L2 as bfloat16
    vllm_xla::RunOverColumnBlocks(widened, N / kCols,
                                  std::max<int64_t>(vllm_xla::kBf16VectorBlocks, widened_blocks), pool);
    return ffi::Error::Success();
  }
  if (run == kAvx512Vnni) {
    vllm_xla::FixedPointRows rows;
    const bool quantized =
        K <= vllm_xla::kMaxVnniDepth &&
        (type == ffi::DataType::BF16 ? rows.Quantize(reinterpret_cast<const uint16_t*>(x.untyped_data()), M, K, group)
                                     : rows.Quantize(reinterpret_cast<const float*>(x.untyped_data()), M, K, group));
    const int64_t blocks = std::max<int64_t>(kAvx512Blocks, cached_blocks);
    if (quantized && scale.element_type() == ffi::DataType::F16) {  // read as they are
      const auto* halves = reinterpret_cast<const uint16_t*>(scale.untyped_data()) + scales.offset;
      const vllm_xla::VnniInt8<uint16_t> problem{&rows, w_values, halves, y->typed_data(), M, K, N};
      vllm_xla::RunOverColumnBlocks(problem, N / kCols, blocks, pool);
      return ffi::Error::Success();
    }
    if (quantized) {
      const auto* floats = reinterpret_cast<const float*>(scale.untyped_data()) + scales.offset;
      const vllm_xla::VnniInt8<float> problem{&rows, w_values, floats, y->typed_data(), M, K, N};
      vllm_xla::RunOverColumnBlocks(problem, N / kCols, blocks, pool);
      return ffi::Error::Success();
    }
    // Not finite values (the float product carries them as it would), rows too small for the
    // fixed point, or a depth past int32's reach: the float path.
  }
  std::vector<float> wide, wide_scales;
  const float* s_values = FloatScales(scale, scales.offset, scale_count, wide_scales);
  const float* x_values = reinterpret_cast<const float*>(x.untyped_data());
  if (type == ffi::DataType::BF16) {
    WidenRows(x, M, K, wide);
    x_values = wide.data();
  }
  if (run == kAvx512Bf16 || run == kAvx512Vnni) run = kAvx512;  // widened in registers
  const Int8Problem problem{x_values, w_values, s_values, y->typed_data(), M, K, N, group};
  if (run == kAvx512) {
    vllm_xla::RunOverColumnBlocks(Avx512Int8{problem}, N / kCols, std::max<int64_t>(kAvx512Blocks, cached_blocks),
                                  pool);
  } else {
    vllm_xla::RunOverColumnBlocks(Avx2Int8{problem}, N / kCols, std::max<int64_t>(2, cached_blocks), pool);
  }
  return ffi::Error::Success();
}

#else  // not x86-64

bool IsaUsable(Int8Isa) { return false; }

ffi::Error DenseInt8(ffi::ThreadPool, ffi::AnyBuffer, ffi::Buffer<ffi::S8>, ffi::AnyBuffer,
                     ffi::ResultBuffer<ffi::F32>, int32_t, int32_t) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "the int8 dense kernel needs an x86-64 CPU");
}

#endif

}  // namespace

// The int8 dense paths this process may run, as a bit mask: bit 1 AVX-512, bit 2 AVX-512 BF16,
// bit 3 AVX2, bit 4 AVX-512 VNNI, bit 5 AMX.
extern "C" int VllmXlaDenseInt8Isas() {
  return (IsaUsable(kAvx512) ? 1 << kAvx512 : 0) | (IsaUsable(kAvx512Bf16) ? 1 << kAvx512Bf16 : 0) |
         (IsaUsable(kAvx2) ? 1 << kAvx2 : 0) | (IsaUsable(kAvx512Vnni) ? 1 << kAvx512Vnni : 0) |
         (IsaUsable(kAmx) ? 1 << kAmx : 0);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(VllmXlaDenseInt8, DenseInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("isa")
                                  .Attr<int32_t>("layer"));
