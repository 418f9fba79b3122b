# SPDX-License-Identifier: Apache-2.0
"""Stacked KV caches: how many layers' caches an array holds, where each layer's pages are, and
the default page size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import AttentionMetadata
from tpu_platform.kv_cache import (
    allocate_stacked_caches,
    available_kv_bytes,
    caches_per_array,
    kv_bytes_per_token,
    pages_for_sequences,
)
from tpu_platform.runner_config import default_page_size


def test_all_caches_share_one_array_until_their_slots_pass_int32():
    assert caches_per_array(30, 4000, 16) == 30
    # 500k pages of 128 tokens: 64M slots a cache, so 33 caches an array (2**31 // 2**26 = 32.x).
    assert caches_per_array(80, 500_000, 128) == 33
    assert caches_per_array(3, 2**31 // 16, 16) == 1  # one cache alone past the range: one an array
    arrays = jax.eval_shape(lambda: allocate_stacked_caches(80, 500_000, 128, 2, 64, jnp.bfloat16, "xla"))
    assert [a.shape[1] for a in arrays] == [33 * 500_000, 33 * 500_000, 14 * 500_000]  # [2K, pages, S*D]
    assert all(a.shape[1] * 128 < 2**31 for a in arrays)


@pytest.mark.parametrize(
    ("layer_caches", "per_array", "want"),
    [
        ((), 0, [(0, 0), (0, 10), (0, 20), (0, 30)]),  # one array, 10 pages a layer
        ((), 3, [(0, 0), (0, 10), (0, 20), (1, 0)]),
        ((0, 1, 0, 1), 0, [(0, 0), (0, 10), (0, 0), (0, 10)]),  # two groups' layers sharing caches
    ],
)
def test_each_layer_finds_its_array_and_first_page(layer_caches, per_array, want):
    zeros = jnp.zeros(4, jnp.int32)
    md = AttentionMetadata(
        slot_mapping=zeros, kv_lens=zeros, page_indices=zeros.reshape(2, 2), cu_q_lens=zeros,
        num_seqs=zeros[:1], layer_caches=layer_caches, cache_pages=10, caches_per_array=per_array,
    )  # fmt: skip
    got = []
    for layer in range(4):
        array, layer_md = md.for_layer(layer)
        assert (layer_md.cache_pages, layer_md.caches_per_array, layer_md.layer_caches) == (0, 0, ())
        got.append((array, layer_md.first_page))
    assert got == want
    np.testing.assert_array_equal(md.for_layer(0)[1].slot_mapping, zeros)


@pytest.mark.parametrize(
    ("device_kind", "kv_cache_dtype", "expected"),
    [
        ("cpu", None, 128),  # as vLLM's CPU backend: longer runs for decode attention to read
        ("cpu", "float8_e5m2", 128),
        ("tpu", None, 16),
        ("tpu", "float8_e4m3fn", 32),  # one whole (32, 128) tile of 8-bit values
        ("gpu", "bfloat16", 16),
        ("gpu", "float8_e5m2", 32),
        (None, None, 16),  # the plugin active without VLLM_XLA_PLATFORM: a TPU host
    ],
)
def test_default_page_size_by_device_and_cache_dtype(device_kind, kv_cache_dtype, expected):
    assert default_page_size(device_kind, kv_cache_dtype) == expected


class _Device:
    """A device reporting `memory_stats` as a TPU or GPU does."""

    platform, device_kind = "tpu", "TPU v5 lite"

    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def test_kv_budget_takes_vllms_kv_cache_memory_bytes_first():
    cpu = jax.devices("cpu")[0]
    assert available_kv_bytes(cpu, memory_utilization=0.9, cpu_kv_cache_gb=0.5) == 1 << 29
    assert available_kv_bytes(cpu, memory_utilization=0.9, cpu_kv_cache_gb=0.5, explicit_bytes=12345) == 12345
    tpu = _Device(limit=16 << 30, in_use=2 << 30)
    assert available_kv_bytes(tpu, memory_utilization=0.5, cpu_kv_cache_gb=1) == 6 << 30
    fits = available_kv_bytes(tpu, memory_utilization=0.5, cpu_kv_cache_gb=1, explicit_bytes=10 << 30)
    assert fits == 10 << 30  # past gpu_memory_utilization's share: it is the user's explicit size
    with pytest.raises(ValueError, match=r"does not fit on TPU v5 lite.*lower --kv-cache-memory-bytes"):
        available_kv_bytes(tpu, memory_utilization=0.5, cpu_kv_cache_gb=1, explicit_bytes=15 << 30)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be positive"):
        available_kv_bytes(cpu, memory_utilization=0.9, cpu_kv_cache_gb=1, explicit_bytes=0)


def test_pages_for_sequences_round_up_and_keep_vllms_null_page():
    assert pages_for_sequences(1, 2048, 128) == 17
    assert pages_for_sequences(3, 130, 128) == 3 * 2 + 1
    # SmolLM2-135M in bfloat16: 30 layers, 3 kv heads of 64: 23,040 bytes a token.
    assert kv_bytes_per_token(30, 3, 64, 2) == 23_040
    for backend in ("xla", "cpu_native"):  # neither layout adds anything: 4 layers, 2 pages of 16
        arrays = jax.eval_shape(lambda b=backend: allocate_stacked_caches(4, 2, 16, 3, 64, jnp.bfloat16, b))
        assert sum(a.size * a.dtype.itemsize for a in arrays) == 2 * 16 * kv_bytes_per_token(4, 3, 64, 2)
