# SPDX-License-Identifier: Apache-2.0
"""A hybrid model's caches (tpu_platform/state_cache.py): one a layer, state pools for the Gated
DeltaNet layers and KV pages for the attention ones, in the structure the model takes them;
the share of the memory budget the worker declares keeps both within it; under speculation, the
block of the last row kept put first after a step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig
from pallas_kernels import allocate_kv_cache
from tests.models.tiny_qwen3_next import ARCHITECTURES
from tpu_platform.buckets import StepBuckets
from tpu_platform.inputs import prepare_step
from tpu_platform.request_table import RequestTable
from tpu_platform.sampling import SamplingOptions
from tpu_platform.speculation.draft_model import kv_share
from tpu_platform.state_cache import (
    allocate_layer_caches,
    block_bytes,
    keep_accepted_states,
    kv_budget_share,
    state_shapes_and_dtypes,
    state_slot_bytes,
)
from tpu_platform.step_program import KVLayout
from tpu_platform.step_update import NewRequest


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


@pytest.mark.parametrize("tp", [1, 2])
def test_a_drafts_pages_beside_the_pages_and_the_pools_stay_in_the_budget(tp):
    """A draft model beside a hybrid target: each block id also takes a page of the draft's caches
    (the worker's split, `kv_share` then `kv_budget_share`)."""
    config = _config(4)
    page, draft_page, budget = 4096, 1000, 1 << 30
    state = state_slot_bytes(config, jnp.float32, tp)
    assert block_bytes(config, page, jnp.float32, tp) == 1 * page + 3 * state  # 1 full layer, 3 linear
    target = kv_share(block_bytes(config, page, jnp.float32, tp), draft_page, budget)
    blocks = int(target * kv_budget_share(config, page, jnp.float32, tp)) // page  # a layer a group
    allocated = blocks * (page + 3 * state + draft_page)
    assert budget * 0.99 < allocated <= budget


def test_a_model_without_state_layers_declares_the_whole_budget():
    fields = {k: v for k, v in ARCHITECTURES["Qwen3NextForCausalLM"][1].items()}
    llama = ModelConfig.from_hf_dict({**fields, "architectures": ["LlamaForCausalLM"]})
    assert llama.state_layers == () and kv_budget_share(llama, 4096, jnp.float32) == 1.0


def test_the_block_of_the_last_row_kept_goes_first():
    """Under speculation with k = 2 (three blocks a request in each state group): a step's
    request of at most three rows left the state after its row j in its block j; once recorded,
    the block after its last row kept is swapped first in every state group, where the next
    step starts. A longer prefill chunk left its state first already; attention pages stay."""
    layout = dataclasses.replace(KVLayout.for_model(_config()), state_columns=3)
    assert layout.state_groups == (0, 1, 2)
    table = RequestTable(8, 64, 4, layout.num_groups)
    # request: (tokens computed before the step, rows scheduled, tokens known once recorded)
    steps = {
        "one draft kept": (10, 3, 10 + 2 + 1),  # its token, then one accepted draft and a bonus
        "none kept": (10, 3, 10 + 2),
        "long chunk": (0, 5, 8),  # a prompt of 8, partly computed
        "both kept": (10, 3, 10 + 2 + 2),
        "short chunk": (0, 2, 8),  # two prompt rows: both kept
    }
    for i, (name, (computed, _, known)) in enumerate(steps.items()):
        blocks = [[100 * g + 10 * i + j for j in range(3 if g < 3 else 1)] for g in range(4)]
        row = table.add(NewRequest(name, list(range(1, 9)), blocks, computed, SamplingOptions()))
        table.num_tokens[row] = known
    rows = np.arange(len(steps), dtype=np.int32)
    scheduled = np.array([s[1] for s in steps.values()], np.int32)
    buckets = StepBuckets.for_limits(
        max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64, page_size=16
    )
    before = table.block_table.copy()
    keep_accepted_states(table, prepare_step(table, rows, scheduled, buckets, 16), layout)
    order = {"one draft kept": [1, 0, 2], "both kept": [2, 1, 0], "short chunk": [1, 0, 2]}
    for i, name in enumerate(steps):
        for g in range(3):
            np.testing.assert_array_equal(
                table.block_table[g, i, :3], before[g, i, order.get(name, [0, 1, 2])], err_msg=name
            )
    np.testing.assert_array_equal(table.block_table[3], before[3])
