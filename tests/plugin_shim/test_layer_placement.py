# SPDX-License-Identifier: Apache-2.0
"""How the worker maps vLLM's KV-cache groups onto our layers' caches, KV-shared layers included."""

import types

import pytest

from plugin_shim.worker import kv_layout, layer_name
from tpu_platform.step_program import KVLayout


def _config(*groups: list[int]):
    return types.SimpleNamespace(
        kv_cache_groups=[types.SimpleNamespace(layer_names=[layer_name(i) for i in g]) for g in groups]
    )


def test_one_group_is_one_cache_a_layer():
    assert kv_layout(_config([0, 1, 2]), 3) == KVLayout((), (), 3, 1)


def test_layers_of_different_groups_share_arrays_by_position():
    # Sliding layers 0, 2 and full layers 1, 3 (Gemma 2/3's alternation).
    assert kv_layout(_config([0, 2], [1, 3]), 4) == KVLayout((0, 1, 0, 1), (0, 0, 1, 1), 2, 2)


def test_kv_shared_layers_take_their_source_s_group_and_cache():
    # Gemma 4: layers 2 and 3 reported no spec and read layers 0 and 1's caches.
    assert kv_layout(_config([0], [1]), 4, (0, 1, 0, 1)) == KVLayout((0, 1, 0, 1), (0, 0, 0, 0), 1, 2)
    # One group: still explicit, so the runner allocates only the sources' caches.
    assert kv_layout(_config([0, 1]), 3, (0, 1, 1)) == KVLayout((0, 0, 0), (0, 1, 1), 2, 1)


def test_a_layer_without_a_group_is_named():
    with pytest.raises(ValueError, match="no group for layers"):
        kv_layout(_config([0]), 2)
