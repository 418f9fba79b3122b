# SPDX-License-Identifier: Apache-2.0
"""Draft models, EAGLE and EAGLE-3 heads and MTP layers at `tensor_parallel_size=2`, on 2 simulated CPU
devices in a subprocess each (`spec_tp_worker.py`: the device count is fixed when JAX starts),
through the runner (no vLLM): a prompt prefilled in two chunks, then verification steps whose
drafts were the proposer's own or made to keep 3, 1 and 2 tokens. Every step's output is the
target's greedy continuation (transformers): greedy with speculation is greedy without, token
for token. Every proposal equals the independent reference's (the draft's greedy tokens in
transformers, the torch references of the heads), so the split drafter and its split cache hold
the right entries. Every drafter parameter is placed as the rules table says, the caches are
split on the KV heads (a latent cache whole on each device), and nothing compiles after warm-up.
A hybrid target (Qwen3-Next with its own MTP layer, or with an EAGLE-3 head) verifies drafts kept
none, one, all and none:
each Gated DeltaNet layer keeps a state after each verified row in its 1 + k state blocks, its
pools split on channels and heads as `pallas_kernels.state_partition_specs` says.
The EAGLE and EAGLE-3 heads run in `make test`; the draft model, the MTP layer (a DeepSeek
block: latent attention, experts) and the hybrid targets in `make test-full` (their one-device
forms: `test_qwen3_next_mtp.py`, `test_draft_model.py` in `make test`, `test_hybrid_eagle3.py`
in `make test-full`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.xla_flags import with_host_devices

pytestmark = pytest.mark.slow  # 2 simulated devices in a subprocess, a minute or more each


def _run(method: str, tmp_path) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": with_host_devices(2),
        "JAX_PLATFORMS": "cpu",
    }
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.tpu_platform.spec_tp_worker", method, str(tmp_path), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out.read_text())


def _check(result: dict, split: tuple[str, ...]) -> None:
    assert result["outputs"] == result["greedy"]
    assert result["drafts"] == result["reference_drafts"]
    assert result["stats"]["kept"] >= 6  # drafts kept: the target's own continuation, 3, 1 and 2
    assert result["compiles_after_warmup"] == 0
    params = result["params"]
    assert all(p["spec"] == p["rule"] and p["devices"] == 2 for p in params.values()), params
    for name in split:  # split, not whole on both devices
        assert "model" in params[name]["spec"], (name, params[name])


def _heads_split(cache: dict) -> bool:
    """A cache split on its KV heads: each device holds half of the heads' axis."""
    axis = cache["spec"].index("model")
    return cache["shard"][axis] * 2 == cache["shape"][axis]


def test_an_eagle3_head_split_over_two_devices_drafts_as_the_reference(tmp_path):
    result = _run("eagle3", tmp_path)
    split = ("layer.self_attn.qkv_proj.kernel", "layer.mlp.down_proj.kernel", "lm_head.kernel")
    _check(result, (*split, "embed_tokens.embedding"))  # the target's shared table, vocab-parallel
    assert result["params"]["fc.kernel"]["spec"] == []  # small: whole on each device
    assert all(_heads_split(cache) for cache in result["caches"])


def test_an_eagle_head_split_over_two_devices_drafts_as_the_reference(tmp_path):
    result = _run("eagle", tmp_path)
    split = ("layer.self_attn.qkv_proj.kernel", "layer.mlp.down_proj.kernel")
    # The target's embedding and LM head, shared: vocab-parallel as the target's.
    _check(result, (*split, "embed_tokens.embedding", "lm_head.kernel"))
    assert result["params"]["fc.kernel"]["spec"] == []  # small: whole on each device
    assert all(_heads_split(cache) for cache in result["caches"])


@pytest.mark.full  # the EAGLE-3 test's path with a whole draft model's programs
def test_a_draft_model_split_over_two_devices_drafts_its_own_greedy_tokens(tmp_path):
    result = _run("draft_model", tmp_path)
    layer = "model.layers.0."
    _check(result, (f"{layer}self_attn.qkv_proj.kernel", f"{layer}mlp.gate_up_proj.kernel", "lm_head.kernel"))
    assert all(_heads_split(cache) for cache in result["caches"])  # its one KV head repeated per device


@pytest.mark.full  # a DeepSeek block's programs on the mesh: two minutes
def test_an_mtp_layer_split_over_two_devices_drafts_as_the_reference(tmp_path):
    result = _run("mtp", tmp_path)
    split = ("block.self_attn.q_b_proj.kernel", "block.mlp.experts.gate_proj.kernel", "shared_head.kernel")
    _check(result, split)
    assert [cache["spec"] for cache in result["caches"]] == [[]]  # the latent cache, whole on each device


def _check_hybrid(result: dict, split: tuple[str, ...]) -> None:
    assert result["outputs"] == result["greedy"]  # drafts kept: none, 1, all 3, none
    assert result["drafts"] == result["reference_drafts"]
    assert result["stats"]["kept"] == 0 + 1 + 3 + 0
    assert result["compiles_after_warmup"] == 0
    assert result["state_columns"] == 1 + 3
    params = result["params"]
    assert all(p["spec"] == p["rule"] and p["devices"] == 2 for p in params.values()), params
    assert all("model" in params[name]["spec"] for name in split), {n: params[n] for n in split}
    assert all(_heads_split(cache) for cache in result["caches"])


@pytest.mark.full  # a hybrid target's programs and the layer's on the mesh: minutes
def test_a_hybrid_targets_mtp_layer_split_over_two_devices_keeps_a_state_per_verified_row(tmp_path):
    result = _run("hybrid_mtp", tmp_path)
    split = ("block.self_attn.qkv_proj.kernel", "block.mlp.experts.gate_proj.kernel", "shared_head.kernel")
    _check_hybrid(result, split)
    pools = result["state_pools"]
    assert len(pools) == 2 * 3  # a conv and a recurrent pool in each of 3 Gated DeltaNet layers
    for pool in pools:  # split as the rules say, each device holding half of the split axis
        assert pool["spec"] == pool["rule"], pool
        axis = pool["spec"].index("model")
        assert pool["shard"][axis] * 2 == pool["shape"][axis], pool


@pytest.mark.full  # a hybrid target's programs and the head's on the mesh: minutes
def test_an_eagle3_head_on_a_hybrid_target_split_over_two_devices_drafts_as_the_reference(tmp_path):
    """The head reads the split target's Gated DeltaNet and attention layers' outputs (whole on
    each device) and its cache, split on the KV heads, follows the full-attention group's tables."""
    result = _run("hybrid_eagle3", tmp_path)
    _check_hybrid(result, ("layer.self_attn.qkv_proj.kernel", "layer.mlp.down_proj.kernel", "lm_head.kernel"))
    assert result["params"]["fc.kernel"]["spec"] == []  # small: whole on each device
