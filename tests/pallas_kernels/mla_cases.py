# SPDX-License-Identifier: Apache-2.0
"""Ragged batches for the latent attention (MLA) kernels, shared by the TPU and GPU kernel tests
and the compile tests: cases, their arrays, and a step through any backend's own cache layout.

Every axis of the kernels' grid appears at least once: decode only, prefill only, mixed with
padding slots (num_seqs < R) and padding rows, lengths on exact page boundaries, several layers
in one cache array (`first_page`), float32, bfloat16 and float8 caches, DeepSeek's widths
(latent 512, rope 64) and small ones, and odd tunings (query blocks spanning sequences, KV
blocks that do not divide a sequence's pages, more KV splits than blocks).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import allocate_latent_cache, mla_paged_attention, write_latent

# Largest |kernel - reference| allowed, relative to max |reference| (outputs are O(1)).
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class MlaCase:
    """One ragged batch. Sequences beyond len(q_lens) up to num_slots are padding slots."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_slots: int
    page_size: int
    num_heads: int
    latent_dim: int = 32
    rope_dim: int = 16
    dtype: type = jnp.float32
    kv_dtype: type | None = None  # the cache's values, when not `dtype` (float8)
    first_page: int = 0  # the layer's first page in a cache of several layers
    pad_tokens: int = 3  # padding query rows after the last sequence
    tpu_tuning: tuple[tuple[str, int], ...] = ()
    gpu_tuning: tuple[tuple[str, int], ...] = ()
    seed: int = 0

    @property
    def cache_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.kv_dtype or self.dtype)


# fmt: off
GRID = (
    # name, q_lens, kv_lens, R, S, H, ...
    MlaCase("decode_p16_h8", (1, 1, 1, 1), (1, 17, 40, 130), 8, 16, 8),  # T = 7 <= R: a decode bucket
    MlaCase("prefill_p16_h4", (7, 20), (7, 20), 2, 16, 4, pad_tokens=0),
    MlaCase("mixed_p16_h4_padding_slots", (1, 9, 5), (37, 20, 5), 5, 16, 4),
    MlaCase("page_boundaries_p8_h2", (16, 1, 8), (16, 32, 24), 3, 8, 2,
            tpu_tuning=(("num_kv_pages_per_block", 2),), gpu_tuning=(("num_kv_pages_per_block", 2),)),
    MlaCase("layers_in_one_array_p16_h4", (1, 6), (50, 6), 3, 16, 4, first_page=11),
    MlaCase("mixed_p16_h16_bf16", (1, 12, 1), (64, 12, 100), 4, 16, 16, dtype=jnp.bfloat16),
    MlaCase("decode_p32_h4_fp8", (1, 1, 1), (5, 33, 90), 3, 32, 4, dtype=jnp.bfloat16,
            kv_dtype=jnp.float8_e4m3fn),
    MlaCase("mixed_p16_deepseek_widths_bf16", (1, 5), (70, 5), 2, 16, 8, latent_dim=512,
            rope_dim=64, dtype=jnp.bfloat16),
    MlaCase("mixed_p16_odd_tuning", (5, 1, 12, 1, 2), (5, 97, 60, 16, 48), 7, 16, 3,
            tpu_tuning=(("num_queries_per_block", 3), ("num_kv_pages_per_block", 3)),
            gpu_tuning=(("num_queries_per_block", 3), ("num_kv_pages_per_block", 2), ("num_kv_splits", 5))),
    MlaCase("empty_batch", (), (), 2, 16, 4),
)
# Small enough for the fast tier and for TPU interpret mode (simulated DMAs, slow): several
# query blocks and sequences, prefetch across sequences, a padding slot, a later layer's pages.
SMALL = MlaCase("small_mixed_layers", (1, 9), (40, 9), 3, 16, 4, first_page=3,
                tpu_tuning=(("num_queries_per_block", 4), ("num_kv_pages_per_block", 2)),
                gpu_tuning=(("num_queries_per_block", 4), ("num_kv_pages_per_block", 2),
                            ("num_kv_splits", 2)))
# fmt: on


@dataclasses.dataclass(frozen=True)
class MlaBatch:
    """A case's arrays: the rows of every cached token, written in shuffled order with padding."""

    q: jax.Array  # [T, H, L + R] absorbed queries
    latent: jax.Array  # [N, L], N written tokens (some padding)
    k_rope: jax.Array  # [N, R]
    slot_mapping: jax.Array  # [N], -1 for padding
    kv_lens: jax.Array  # [R]
    page_indices: jax.Array  # [R, P]
    cu_q_lens: jax.Array  # [R + 1]
    num_seqs: jax.Array  # [1]
    num_pages: int


def build_batch(case: MlaCase) -> MlaBatch:
    rng = np.random.default_rng(case.seed)
    num_seqs, size = len(case.q_lens), case.page_size
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
    width = case.latent_dim + case.rope_dim

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape, np.float32), case.dtype)

    return MlaBatch(
        # Scores of O(1) whatever the width: the softmax is neither flat nor one-hot.
        q=normal(total + case.pad_tokens, case.num_heads, width, scale=width**-0.25),
        latent=normal(len(slots), case.latent_dim),
        k_rope=normal(len(slots), case.rope_dim),
        slot_mapping=jnp.asarray(slots),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu_q_lens),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
        num_pages=num_pages,
    )


def run_backend(case: MlaCase, batch: MlaBatch, backend: str, **kwargs) -> jax.Array:
    """Writes the batch's rows through `backend`'s own write, then runs its attention (one jit)."""
    kv_dtype = case.cache_dtype
    width = case.latent_dim + case.rope_dim

    def step(q, latent, k_rope, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
        pages = batch.num_pages + case.first_page
        cache = allocate_latent_cache(pages, case.page_size, width, kv_dtype, backend=backend)
        common = dict(backend=backend, kv_dtype=kv_dtype.name, first_page=case.first_page)
        interpret = kwargs.get("interpret", False)
        cache = write_latent(cache, latent, k_rope, slot_mapping, **common, interpret=interpret)
        return mla_paged_attention(
            q, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=width**-0.5, latent_dim=case.latent_dim, **common, **kwargs,
        )  # fmt: skip

    return jax.jit(step)(
        batch.q, batch.latent, batch.k_rope, batch.slot_mapping, batch.kv_lens, batch.page_indices,
        batch.cu_q_lens, batch.num_seqs,
    )  # fmt: skip


def assert_matches_reference(case: MlaCase, backend: str, **kwargs) -> float:
    """Runs `backend` on the case and asserts it matches the `xla` reference; the max error."""
    batch = build_batch(case)
    expected = np.asarray(run_backend(case, batch, "xla").astype(jnp.float32))
    actual = np.asarray(run_backend(case, batch, backend, **kwargs).astype(jnp.float32))
    assert actual.shape == expected.shape
    assert np.all(np.isfinite(actual)), "non-finite output"
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    err = float(np.max(np.abs(actual - expected), initial=0.0))
    tolerance = TOLERANCE[case.dtype]
    assert err <= tolerance * scale, f"max |error| {err:.3g} > {tolerance} * {scale:.3g}"
    padding = np.asarray(batch.cu_q_lens)[len(case.q_lens)]
    np.testing.assert_array_equal(actual[padding:], 0.0)  # padding rows are zeros
    return err
