# SPDX-License-Identifier: Apache-2.0
"""What the kernel compile tests compile: a layer's KV write and ragged attention, per case.

A case is the static shapes of one call (no data: the compilers see only shapes). Two sources:
* the interpret-mode numerics grid (tests/pallas_kernels/conftest.py GRID), with its odd tunings,
  so every shape whose numbers the interpret tests check also compiles for the real chip;
* realistic serving steps at production tuning (the kernels' tuned_block_sizes defaults, the
  runner's page sizes: 16 tokens, 32 for float8): head dim 128 (Llama-3.1-8B, Qwen3-8B: 32
  query heads over 8 kv heads) and 256 (Gemma-2-9B: 16 over 8, sliding window 4096, soft cap
  50), 64-256 sequences, 2k-32k contexts, bfloat16 and float8_e4m3fn caches, decode buckets
  (one row a sequence) and prefill/mixed buckets; head dim 64 with attention sinks and a
  128-token window (GPT-OSS: 64 query heads over 8 kv heads); chunked attention over 16k
  contexts (Llama 4 Scout: 40 query heads over 8 kv heads, chunks of 8192); head dim 512 (Gemma
  4). The grid covers each dimension, not their product: a cache of 256 sequences x 32k tokens
  would not fit one v5e.
Cases marked `expect_error` must be refused by the compiler: they prove a VMEM or shared-memory
overflow fails its case (a compiler that stopped checking would pass them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tests.pallas_kernels.conftest import GRID, Case

TPU_TARGETS = ("v5e-1", "v6e-1", "v5p-8", "v4-8")
GPU_TARGETS = ("h100x1", "a100x1", "l4x1")
BACKEND = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}


@dataclasses.dataclass(frozen=True)
class CompileCase:
    """Static shapes of one layer step: T query rows over R sequence slots of `context` tokens."""

    name: str
    num_tokens: int  # T: this step's query rows (and K/V rows written)
    num_slots: int  # R
    context: int  # tokens a sequence's block table reaches (P = context / page size)
    page_size: int
    head_dim: int
    num_kv_heads: int
    group: int  # query heads per kv head
    dtype: str = "bfloat16"
    kv_dtype: str | None = None  # the cache's values, when not `dtype`
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False  # attention sinks, `[H]` float32 (an argument of the step)
    attention_chunk_size: int | None = None  # chunked local attention
    tuning: tuple[tuple[str, int], ...] = ()  # kernel keywords; () = production defaults
    extra_pages: int = 0  # cache pages beyond R * P
    expect_error: str = ""  # a substring of the compiler's refusal, for cases that must fail

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def num_pages(self) -> int:
        return self.num_slots * self.pages_per_seq + self.extra_pages

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype


def from_interpret_case(case: Case, platform: str) -> CompileCase:
    """The shapes (and the platform's tuning) of an interpret-mode grid case."""
    tuning = case.tpu_tuning if platform == "tpu" else case.gpu_tuning
    return CompileCase(
        name=f"grid_{case.name}",
        num_tokens=sum(case.q_lens) + case.pad_tokens,
        num_slots=case.num_slots,
        context=max(case.kv_lens, default=1),
        page_size=case.page_size,
        head_dim=case.head_dim,
        num_kv_heads=case.num_kv_heads,
        group=case.group,
        dtype=jnp.dtype(case.dtype).name,
        kv_dtype=jnp.dtype(case.kv_dtype).name if case.kv_dtype else None,
        sliding_window=case.sliding_window,
        soft_cap=case.soft_cap,
        sinks=case.sinks,
        attention_chunk_size=case.attention_chunk_size,
        tuning=tuning,
        extra_pages=5,
    )


FP8 = "float8_e4m3fn"
GEMMA = {"sliding_window": 4096, "soft_cap": 50.0}
# fmt: off
REALISTIC = (
    # name, T, R, context, page size, D, K, G, ...
    CompileCase("decode_d128_r64_2k",            64,   64,  2048, 16, 128, 8, 4),
    CompileCase("decode_d128_r256_8k_fp8",       256,  256, 8192, 32, 128, 8, 4, kv_dtype=FP8),
    CompileCase("decode_d128_r64_32k",           64,   64, 32768, 16, 128, 8, 4),
    CompileCase("mixed_d128_r64_t512_4k",        512,  64,  4096, 16, 128, 8, 4),
    CompileCase("prefill_d128_r16_t2048_32k_fp8", 2048, 16, 32768, 32, 128, 8, 4, kv_dtype=FP8),
    CompileCase("decode_d256_r128_8k_window_cap", 128, 128, 8192, 16, 256, 8, 2, **GEMMA),
    CompileCase("mixed_d256_r64_t1024_8k_fp8_window_cap", 1024, 64, 8192, 32, 256, 8, 2,
                kv_dtype=FP8, **GEMMA),
    CompileCase("decode_d64_r128_8k_window_sinks", 128, 128, 8192, 16, 64, 8, 8,
                sliding_window=128, sinks=True),
    # Llama 4 Scout's chunked layers: 40 query heads over 8 kv heads, chunks of 8192 positions.
    CompileCase("mixed_d128_r64_t512_16k_chunk", 512, 64, 16384, 16, 128, 8, 5,
                attention_chunk_size=8192),
    # Head dim 512 (Gemma 4: its full layers' width, which every layer's cache takes; 1024-token
    # windows on the sliding ones).
    CompileCase("decode_d512_r32_4k_window", 32, 32, 4096, 16, 512, 8, 2, sliding_window=1024),
    CompileCase("mixed_d512_r16_t512_4k", 512, 16, 4096, 16, 512, 8, 2),
)
# fmt: on
# Tunings the compilers must refuse: KV blocks too large for the scoped VMEM limit given (TPU),
# or for the GPU's shared memory per block (the L4's 99 KiB; 227 KiB on H100).
OVERFLOWS = {
    "tpu": CompileCase(
        "overflow_vmem",
        64,
        64,
        2048,
        16,
        128,
        8,
        4,
        tuning=(("num_kv_pages_per_block", 128), ("vmem_limit_bytes", 1 << 20)),
        expect_error="vmem",
    ),
    "cuda": CompileCase(
        "overflow_shared_memory",
        64,
        64,
        2048,
        16,
        128,
        8,
        4,
        tuning=(("num_kv_pages_per_block", 64),),
        expect_error="Shared memory size limit exceeded",
    ),
}  # fmt: skip


# Triton converts float8_e4m3fn only on compute capability 8.9 and newer: compiling a kernel
# that reads such a cache for an A100 (8.0) aborts the compiler process (see the GPU test).
NEEDS_SM89 = "float8_e4m3fn"


def cases_for(target: str, platform: str) -> tuple[CompileCase, ...]:
    """The cases compiled for `target`: everything on the main chip of each platform (v5e, v6e,
    H100), the realistic cases on the other chips (their limits differ: VMEM size, shared memory)."""
    grid = tuple(from_interpret_case(c, platform) for c in GRID)
    if target in ("v5e-1", "v6e-1", "h100x1"):
        return (*grid, *REALISTIC, OVERFLOWS[platform])
    if target in ("v5p-8", "v4-8"):  # other generations' Mosaic: the decode shapes, 2k and 32k
        return tuple(c for c in REALISTIC if c.name in ("decode_d128_r64_2k", "decode_d128_r64_32k"))
    if target == "a100x1":  # plus the grid's float8_e5m2 case, which Triton converts on 8.0
        cases = (*REALISTIC, *(c for c in grid if c.cache_dtype == "float8_e5m2"), OVERFLOWS[platform])
        return tuple(c for c in cases if c.cache_dtype != NEEDS_SM89)
    return (*REALISTIC, OVERFLOWS[platform])


# The interpret grid's points `make test` compiles (on v5e, H100 and A100): one a class no realistic
# case holds (float32, 128-token pages, one and three query heads a KV head, odd tunings, an empty
# batch, float8_e5m2, a chunk beside a window, sinks without one). The others' classes (bfloat16
# windows and caps, head dims 256 and 512, float8_e4m3fn, sinks with a window, chunks) are
# realistic cases'.
GRID_IN_MAKE_TEST = frozenset(
    {
        "grid_decode_p16_d128_g4_2k", "grid_mixed_p128_d128_g3_window",
        "grid_mixed_p16_d64_g1_bf16_window_cap", "grid_mixed_p16_d128_g8_odd_tuning", "grid_empty_batch",
        "grid_mixed_p32_d64_g3_e5m2_window", "grid_decode_p32_d64_g2_chunk_window",
        "grid_decode_p32_d64_g4_sinks",
    }
)  # fmt: skip
# The realistic cases `make test` compiles on the chips that do not take them all (H100, v5p and
# v4 do). v5e and v6e: each case on one of the two (the kernels' code is the same on both; what
# differs, VMEM and tiling, each chip's decode, mixed and float8 cases and its overflow check),
# the plain decode on both, the newer models' features (head dim 512, chunks, sinks) on v6e, the
# chip their one-chip steps compile for. The 2k-token float8 prefill, the longest TPU compile of
# the set, is `make test-full`'s: v5e's 1k-token float8 mixed step holds its class (many query
# rows over a float8 cache), v6e's float8 decode its chip's float8 tiling. A100 and L4 (less
# shared memory a block than the H100): the plain decode and the cases of the largest tiles,
# head dims 256 and 512.
REALISTIC_IN_MAKE_TEST = {
    "v5e-1": frozenset(
        {
            "decode_d128_r64_2k", "decode_d128_r64_32k", "decode_d256_r128_8k_window_cap",
            "mixed_d256_r64_t1024_8k_fp8_window_cap",
        }
    ),
    "v6e-1": frozenset(
        {
            "decode_d128_r64_2k", "decode_d128_r256_8k_fp8", "decode_d64_r128_8k_window_sinks",
            "mixed_d128_r64_t512_16k_chunk", "decode_d512_r32_4k_window", "mixed_d512_r16_t512_4k",
        }
    ),
    **dict.fromkeys(
        ("a100x1", "l4x1"),
        frozenset(
            {
                "decode_d128_r64_2k", "decode_d256_r128_8k_window_cap",
                "mixed_d256_r64_t1024_8k_fp8_window_cap", "decode_d512_r32_4k_window",
                "mixed_d512_r16_t512_4k",
            }
        ),
    ),
}  # fmt: skip
# Where `make test` compiles the grid's points above (the A100 has only the float8_e5m2 one).
GRID_TARGETS = ("v5e-1", "h100x1", "a100x1")


def in_full_only(target: str, case: CompileCase) -> bool:
    """Whether `make test` leaves the pair to `make test-full`: the grid's points outside
    `GRID_IN_MAKE_TEST` (and every one on v6e), the realistic cases outside
    `REALISTIC_IN_MAKE_TEST` where it names the chip. Every overflow check is `make test`'s."""
    if case.expect_error:
        return False
    if case.name.startswith("grid_"):
        return target not in GRID_TARGETS or case.name not in GRID_IN_MAKE_TEST
    return target in REALISTIC_IN_MAKE_TEST and case.name not in REALISTIC_IN_MAKE_TEST[target]


def plan(platform: str) -> list[tuple[str, CompileCase]]:
    """Every (target, case) pair compiled for `platform` ("tpu" or "cuda")."""
    targets = TPU_TARGETS if platform == "tpu" else GPU_TARGETS
    return [(t, c) for t in targets for c in cases_for(t, platform)]


def find_case(platform: str, name: str) -> CompileCase:
    """A case of `platform` by name, whichever targets compile it."""
    grid = tuple(from_interpret_case(c, platform) for c in GRID)
    for case in (*grid, *REALISTIC, OVERFLOWS[platform]):
        if case.name == name:
            return case
    raise ValueError(f"no compile case {name!r} for {platform}")


def abstract_args(case: CompileCase, backend: str, sharding) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(cache, q, k, v, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs[, sinks]),
    abstract."""
    import pallas_kernels

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    cache = jax.eval_shape(
        lambda: pallas_kernels.allocate_kv_cache(
            case.num_pages, case.page_size, case.num_kv_heads, case.head_dim, case.cache_dtype,
            backend=backend,
        )
    )  # fmt: skip
    t, r, d, k = case.num_tokens, case.num_slots, case.head_dim, case.num_kv_heads
    return (
        sds(cache.shape, cache.dtype),
        sds((t, k * case.group, d), case.dtype),
        sds((t, k, d), case.dtype),
        sds((t, k, d), case.dtype),
        sds((t,), jnp.int32),
        sds((r,), jnp.int32),
        sds((r, case.pages_per_seq), jnp.int32),
        sds((r + 1,), jnp.int32),
        sds((1,), jnp.int32),
        *([sds((k * case.group,), jnp.float32)] if case.sinks else []),
    )


def layer_step(case: CompileCase, backend: str):
    """A layer's attention as the model step runs it: write this step's K/V, then attend."""
    import pallas_kernels

    kv_dtype = case.cache_dtype

    def step(cache, q, k, v, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None):
        cache = pallas_kernels.write_kv(cache, k, v, slot_mapping, backend=backend, kv_dtype=kv_dtype)
        out = pallas_kernels.ragged_paged_attention(
            q, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window,
            soft_cap=case.soft_cap, backend=backend, kv_dtype=kv_dtype, sinks=sinks,
            attention_chunk_size=case.attention_chunk_size, **dict(case.tuning),
        )  # fmt: skip
        return out, cache

    return jax.jit(step, donate_argnums=0)
