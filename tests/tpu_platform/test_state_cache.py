# SPDX-License-Identifier: Apache-2.0
"""A hybrid model's caches (tpu_platform/state_cache.py): one a layer, state pools for the Gated
DeltaNet layers and KV pages for the attention ones, in the structure the model takes them;
the share of the memory budget the worker declares keeps both within it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig
from pallas_kernels import allocate_kv_cache
from tests.models.tiny_qwen3_next import ARCHITECTURES
from tpu_platform.state_cache import (
    allocate_layer_caches,
    kv_budget_share,
    state_shapes_and_dtypes,
    state_slot_bytes,
)
from tpu_platform.step_program import KVLayout


def _config(num_layers: int = 4) -> ModelConfig:
    fields = ARCHITECTURES["Qwen3NextForCausalLM"][1]
    return ModelConfig.from_hf_dict(
        {**fields, "num_hidden_layers": num_layers, "architectures": ["Qwen3NextForCausalLM"]}
    )


def test_state_pools_beside_kv_pages_one_cache_a_layer():
    config = _config()
    layout = KVLayout.for_model(config)
    assert layout.state_layers == (0, 1, 2)
    flat = allocate_layer_caches(config, layout, 9, 16, 2, jnp.bfloat16, jnp.bfloat16, "xla")
    caches = jax.tree.unflatten(layout.caches_def, flat)
    conv_channels = 2 * 2 * 16 + 4 * 8  # q and k of 2 key heads of 16, v of 4 value heads of 8
    for conv, recurrent in caches[:3]:
        assert (conv.shape, conv.dtype) == ((9, 3, conv_channels), jnp.bfloat16)
        assert (recurrent.shape, recurrent.dtype) == ((9, 4, 16, 8), jnp.float32)  # the state in float32
        assert not np.asarray(recurrent).any()
    kv = allocate_kv_cache(9, 16, 2, 16, jnp.bfloat16, backend="xla")
    assert (caches[3].shape, caches[3].dtype) == (kv.shape, kv.dtype)
    assert state_slot_bytes(config, jnp.bfloat16) == 3 * conv_channels * 2 + 4 * 16 * 8 * 4
    # One device of two: its half of the conv channels and of the value heads.
    assert state_slot_bytes(config, jnp.bfloat16, 2) == 3 * conv_channels + 2 * 16 * 8 * 4
    shapes, _ = state_shapes_and_dtypes(config, jnp.bfloat16, 2)
    assert shapes == ((3, conv_channels // 2), (2, 16, 8))


@pytest.mark.parametrize(("num_layers", "tp"), [(4, 1), (48, 1), (4, 2)])
def test_declared_budget_holds_the_pages_and_the_pools(num_layers, tp):
    """One device's budget, pages and state slots (`tp` devices: each holds its share)."""
    config = _config(num_layers)
    page, budget = 4096, 1 << 30
    share = kv_budget_share(config, page, jnp.float32, tp)
    # The engine's block count: the declared bytes over one page a layer of its largest group
    # (one of the 4 layers' groups; 12 of 48 layers: the full layers, or a third of the linear).
    blocks = int(budget * share) // (page * num_layers // 4)
    states, full = len(config.state_layers), num_layers - len(config.state_layers)
    allocated = blocks * (full * page + states * state_slot_bytes(config, jnp.float32, tp))
    assert budget * 0.99 < allocated <= budget


def test_a_model_without_state_layers_declares_the_whole_budget():
    fields = {k: v for k, v in ARCHITECTURES["Qwen3NextForCausalLM"][1].items()}
    llama = ModelConfig.from_hf_dict({**fields, "architectures": ["LlamaForCausalLM"]})
    assert llama.state_layers == () and kv_budget_share(llama, 4096, jnp.float32) == 1.0
