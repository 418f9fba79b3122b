# SPDX-License-Identifier: Apache-2.0
"""Shared inputs for the paged-attention tests: a sampled grid of ragged batches and their builder.

A test that takes a `case` argument is parametrized over GRID, one that takes `small_case` over
SMALL_GRID (see pytest_generate_tests), so the TPU and GPU kernel tests run the same batches.
Every axis value of the issue's grid appears at least once: page size 16/32/128, head dim
64/128, Hq/Hkv 1/3/4/8, decode-only, prefill-only and mixed batches, zero-length padding slots
(num_seqs < R), lengths that are exact page multiples, contexts up to 2048, sliding window and
soft cap on and off, attention sinks, chunked local attention, float32 and bfloat16, and float8
caches (e4m3fn, e5m2) under bfloat16 queries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import api
from tests.xla_flags import jit_kernel_run

# Largest |kernel - reference| allowed, relative to max |reference| (outputs are O(1)).
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One ragged batch. Sequences beyond len(q_lens) up to num_slots are padding slots."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_slots: int
    page_size: int
    head_dim: int
    num_kv_heads: int
    group: int  # query heads per kv head (Hq / Hkv)
    dtype: type = jnp.float32
    kv_dtype: type | None = None  # the cache's values, when not `dtype` (float8)
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False  # attention sinks (one random logit a query head)
    attention_chunk_size: int | None = None  # chunked local attention (Llama 4)
    pad_tokens: int = 3  # padding query rows after the last sequence
    tpu_tuning: tuple[tuple[str, int], ...] = ()
    gpu_tuning: tuple[tuple[str, int], ...] = ()
    seed: int = 0


# fmt: off
GRID = (
    # name, q_lens, kv_lens, R, S, D, K, G, dtype, ...
    Case("decode_p16_d128_g4_2k", (1, 1, 1, 1, 1), (1, 17, 32, 200, 2048), 8, 16, 128, 2, 4),
    Case("prefill_p32_d64_g8_bf16_cap", (7, 32, 50), (7, 32, 50), 4, 32, 64, 1, 8, jnp.bfloat16,
         soft_cap=2.0),
    Case("mixed_p128_d128_g3_window", (1, 19, 1, 40), (70, 83, 128, 300), 6, 128, 128, 2, 3,
         sliding_window=48),
    Case("mixed_p16_d64_g1_bf16_window_cap", (33, 1), (1057, 2000), 2, 16, 64, 4, 1, jnp.bfloat16,
         sliding_window=256, soft_cap=3.0, pad_tokens=0),
    Case("decode_p32_d128_g3_bf16_window", (1, 1, 1), (300, 64, 5), 4, 32, 128, 1, 3, jnp.bfloat16,
         sliding_window=100),
    Case("prefill_p128_d64_g4_cap", (128, 3), (128, 3), 3, 128, 64, 2, 4, soft_cap=1.0),
    # Odd tuning: query blocks spanning sequences, KV blocks not dividing P, more splits than blocks.
    Case("mixed_p16_d128_g8_odd_tuning", (5, 1, 12, 1, 2), (5, 97, 60, 16, 48), 7, 16, 128, 1, 8,
         sliding_window=20,
         tpu_tuning=(("num_queries_per_block", 8), ("num_kv_pages_per_block", 3)),
         gpu_tuning=(("num_queries_per_block", 3), ("num_kv_pages_per_block", 2), ("num_kv_splits", 5))),
    Case("decode_p16_d256_g2", (1, 1), (40, 300), 3, 16, 256, 1, 2),  # Dp = 256: two lane tiles
    # Head dim 512 (Gemma 4's full layers: Dp = 512, four lane tiles), decodes and a chunk, bf16.
    Case("mixed_p16_d512_g4_bf16", (1, 7, 1), (30, 7, 90), 4, 16, 512, 1, 4, jnp.bfloat16),
    Case("empty_batch", (), (), 2, 16, 64, 1, 1),
    # Float8 caches (32-token pages: the TPU's 8-bit tile), read as bfloat16 by the Pallas kernels.
    Case("decode_p32_d128_g4_fp8", (1, 1, 1, 1), (5, 40, 300, 1000), 5, 32, 128, 2, 4, jnp.bfloat16,
         kv_dtype=jnp.float8_e4m3fn),
    Case("mixed_p32_d64_g3_e5m2_window", (9, 1, 20), (9, 77, 150), 4, 32, 64, 1, 3, jnp.bfloat16,
         kv_dtype=jnp.float8_e5m2, sliding_window=40),
    # Attention sinks (GPT-OSS: head dim 64, 8 query heads a kv head, windowed and full layers).
    Case("mixed_p16_d64_g8_bf16_sinks_window", (1, 12, 1), (40, 12, 130), 4, 16, 64, 1, 8,
         jnp.bfloat16, sliding_window=16, sinks=True),
    Case("decode_p32_d64_g4_sinks", (1, 1, 1), (3, 64, 200), 3, 32, 64, 2, 4, sinks=True),
    # Chunked local attention (Llama 4): chunks of 48 and 64 positions, rows at chunk edges, a
    # prefill chunk crossing chunk boundaries, and a chunk beside a sliding window.
    Case("mixed_p16_d128_g4_bf16_chunk", (1, 40, 1), (64, 100, 300), 4, 16, 128, 2, 4, jnp.bfloat16,
         attention_chunk_size=48),
    Case("decode_p32_d64_g2_chunk_window", (1, 1, 1), (65, 129, 500), 3, 32, 64, 1, 2,
         sliding_window=40, attention_chunk_size=64),
)

# Tiny batches for TPU interpret mode (simulated DMAs and semaphores, slow): several query blocks,
# a query block spanning sequences, prefetch across sequences, a window that skips first pages
# (and attention chunks of 32, whose bound is the later one for most rows).
SMALL_GRID = (
    Case("small_mixed",           (1, 9, 1), (40, 9, 64), 4, 16, 128, 2, 2,
         tpu_tuning=(("num_queries_per_block", 8), ("num_kv_pages_per_block", 2))),
    Case("small_window_chunk_cap_bf16", (1, 20), (70, 50), 2, 16, 64, 1, 3, jnp.bfloat16,
         sliding_window=24, soft_cap=2.0, attention_chunk_size=32,
         tpu_tuning=(("num_queries_per_block", 16), ("num_kv_pages_per_block", 2))),
    Case("small_sinks_window",    (1, 9),    (30, 9),     2, 16, 64, 1, 4,
         sliding_window=8, sinks=True,
         tpu_tuning=(("num_queries_per_block", 8), ("num_kv_pages_per_block", 2))),
)
# fmt: on


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for name, grid in (("case", GRID), ("small_case", SMALL_GRID)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, grid, ids=[c.name for c in grid])


def pytest_configure(config: pytest.Config) -> None:
    # Registered by pytest-timeout when installed; declared here so the marker never warns.
    config.addinivalue_line("markers", "timeout(seconds): fail a test that runs longer")


@pytest.fixture(autouse=True)
def _reset_tpu_interpret_state():
    yield
    pltpu.reset_tpu_interpret_mode_state()  # a failed interpreted kernel leaves shared state behind


@dataclasses.dataclass(frozen=True)
class Batch:
    """A case's arrays. K/V of every cached token, written in shuffled order with padding slots."""

    q: jax.Array  # [T, H, D]
    k: jax.Array  # [N, K, D], N written tokens (some padding)
    v: jax.Array
    slot_mapping: jax.Array  # [N], -1 for padding
    kv_lens: jax.Array  # [R]
    page_indices: jax.Array  # [R, P]
    cu_q_lens: jax.Array  # [R + 1]
    num_seqs: jax.Array  # [1]
    num_pages: int
    sinks: jax.Array | None  # [H] float32, when the case has them


def build_batch(case: Case) -> Batch:
    rng = np.random.default_rng(case.seed)
    num_seqs = len(case.q_lens)
    size = case.page_size
    pages_per_seq = max(1, -(-max(case.kv_lens, default=1) // size))
    num_pages = case.num_slots * pages_per_seq + 5
    # Shuffled, non-contiguous block table; entries past each sequence's pages are garbage.
    table = rng.permutation(num_pages)[: case.num_slots * pages_per_seq].reshape(case.num_slots, -1)
    table = table.astype(np.int32)
    kv_lens = rng.integers(0, 10**6, case.num_slots).astype(np.int32)  # garbage in padding slots
    kv_lens[:num_seqs] = case.kv_lens
    slots = []
    for i, kv_len in enumerate(case.kv_lens):
        table[i, -(-kv_len // size) :] = rng.integers(10**5, 10**6)
        pos = np.arange(kv_len)
        slots.append(table[i, pos // size] * size + pos % size)
    slots = np.concatenate([*slots, np.full(4, -1)]).astype(np.int32)
    slots = slots[rng.permutation(len(slots))]
    total = sum(case.q_lens)
    cu_q_lens = np.full(case.num_slots + 1, total, np.int32)
    cu_q_lens[: num_seqs + 1] = np.concatenate([[0], np.cumsum(case.q_lens)])
    num_tokens = total + case.pad_tokens
    heads = case.num_kv_heads * case.group

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), case.dtype)

    return Batch(
        q=normal(num_tokens, heads, case.head_dim),
        k=normal(len(slots), case.num_kv_heads, case.head_dim),
        v=normal(len(slots), case.num_kv_heads, case.head_dim),
        slot_mapping=jnp.asarray(slots),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu_q_lens),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
        num_pages=num_pages,
        sinks=jnp.asarray(2 * rng.standard_normal(heads), jnp.float32) if case.sinks else None,
    )


def jit_for_backend(step, backend: str, kwargs: dict):
    """`step` jitted for a kernel check on `backend` with its `kwargs`: the TPU kernel's
    interpret-mode programs at XLA's default level (their run is the cost: `jit_kernel_run`)."""
    return jit_kernel_run(step, long_run=backend == "pallas_tpu" and bool(kwargs.get("interpret")))


def run_backend(case: Case, batch: Batch, backend: str, **kwargs) -> jax.Array:
    """Writes the batch's K/V through `backend`'s own write_kv, then runs its attention (one jit)."""

    kv_dtype = jnp.dtype(case.kv_dtype or case.dtype)

    def step(q, k, v, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, sinks):
        cache = api.allocate_kv_cache(
            batch.num_pages, case.page_size, case.num_kv_heads, case.head_dim, kv_dtype, backend=backend
        )
        cache = api.write_kv(
            cache, k, v, slot_mapping, backend=backend, kv_dtype=kv_dtype.name,
            interpret=kwargs.get("interpret", False),
        )  # fmt: skip
        return api.ragged_paged_attention(
            q,
            cache,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            sm_scale=case.head_dim**-0.5,
            sliding_window=case.sliding_window,
            soft_cap=case.soft_cap,
            backend=backend,
            kv_dtype=kv_dtype.name,
            sinks=sinks,
            attention_chunk_size=case.attention_chunk_size,
            **kwargs,
        )

    return jit_for_backend(step, backend, kwargs)(
        batch.q,
        batch.k,
        batch.v,
        batch.slot_mapping,
        batch.kv_lens,
        batch.page_indices,
        batch.cu_q_lens,
        batch.num_seqs,
        batch.sinks,
    )


def _assert_close(actual: jax.Array, expected: np.ndarray, dtype) -> float:
    actual = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    assert actual.shape == expected.shape
    assert np.all(np.isfinite(actual)), "non-finite output"
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    err = float(np.max(np.abs(actual - expected), initial=0.0))
    assert err <= TOLERANCE[dtype] * scale, f"max |error| {err:.3g} > {TOLERANCE[dtype]} * {scale:.3g}"
    return err


@pytest.fixture(scope="session")
def compare_with_reference():
    """`(case, backend, **kwargs) -> max error`: runs `backend` on the case, asserts it matches xla.

    The reference output of each case is computed once per session (both kernels share it).
    """
    references: dict[Case, np.ndarray] = {}

    def compare(case: Case, backend: str, **kwargs) -> float:
        batch = build_batch(case)
        if case not in references:
            references[case] = np.asarray(run_backend(case, batch, "xla").astype(jnp.float32))
        return _assert_close(run_backend(case, batch, backend, **kwargs), references[case], case.dtype)

    return compare


def numpy_causal_attention(q, k, v, q_lens, kv_lens, sinks=None, attention_chunk_size=None):
    """Dense oracle: q `[T, H, D]`, k/v per sequence `[L_i, K, D]`; query heads share kv heads in
    groups. `sinks [H]`: one more softmax column per head, of that logit, dropped after the softmax.
    `attention_chunk_size`: a query sees only keys of its own chunk of positions."""
    out = []
    for qi, ki, vi, n, length in zip(np.split(q, np.cumsum(q_lens)[:-1]), k, v, q_lens, kv_lens, strict=True):
        group = q.shape[1] // ki.shape[1]
        kh, vh = np.repeat(ki, group, axis=1), np.repeat(vi, group, axis=1)  # [L, H, D]
        scores = np.einsum("thd,lhd->htl", qi, kh)
        positions = length - n + np.arange(n)
        scores = np.where(np.arange(length)[None, None, :] <= positions[None, :, None], scores, -np.inf)
        if attention_chunk_size is not None:
            chunk_start = positions // attention_chunk_size * attention_chunk_size
            scores = np.where(np.arange(length)[None, None, :] >= chunk_start[None, :, None], scores, -np.inf)
        if sinks is not None:  # the sink column, last
            column = np.broadcast_to(np.asarray(sinks)[:, None, None], (*scores.shape[:2], 1))
            scores = np.concatenate([scores, column], axis=-1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        out.append(np.einsum("htl,lhd->thd", p[..., :length], vh))
    return np.concatenate(out)
