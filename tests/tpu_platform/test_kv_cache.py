# SPDX-License-Identifier: Apache-2.0
"""Stacked KV caches: how many layers' caches an array holds, where each layer's pages are, and
the default page size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import AttentionMetadata
from tpu_platform.kv_cache import allocate_stacked_caches, caches_per_array
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
