# SPDX-License-Identifier: Apache-2.0
"""Weights on a tensor-parallel mesh of 8 simulated CPU devices (a process of their own:
`tensor_parallel_weights_worker.py`): streamed from the checkpoint straight to their shards,
and a checkpoint written at TP=2 restored at TP=1 and TP=4 bit for bit as the source loads there.

Tiny Llama with 4 query and 2 KV heads (TP=4 repeats each KV head on two devices) and a tiny
Qwen3-MoE (expert stacks split inside each expert)."""

import json
import os
import subprocess
import sys

import pytest

from tests.models.tiny_checkpoints import save_tiny
from tests.tiny_models import save_tiny_llama
from tests.xla_flags import with_host_devices

# A subprocess per model on 8 simulated devices: slow tier.
pytestmark = pytest.mark.slow

_MODELS = {
    "llama": lambda path: save_tiny_llama(path, seed=3, num_hidden_layers=8),
    "qwen3_moe": lambda path: save_tiny(
        "Qwen3MoeForCausalLM", path, seed=1, num_hidden_layers=4, mlp_only_layers=[1]
    ),
}


@pytest.fixture(scope="module", params=sorted(_MODELS))
def report(request, tmp_path_factory):
    scratch = tmp_path_factory.mktemp(f"tp_weights_{request.param}")
    model_dir = _MODELS[request.param](str(scratch / "model"))
    env = {**os.environ, "XLA_FLAGS": with_host_devices(8), "JAX_PLATFORMS": "cpu"}
    worker = [
        sys.executable,
        "-m",
        "tests.tpu_platform.tensor_parallel_weights_worker",
        model_dir,
        str(scratch),
    ]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("REPORT ", 1)[1])


def test_streamed_weights_reach_their_shards_and_the_host_holds_a_few_tensors(report):
    streamed = report["streamed"]
    placed = streamed["arrays"]
    for name, array in placed.items():
        if array["spec"]:  # split: each of the 4 devices holds a quarter, none the whole
            assert array["devices"] == 4 and array["device_bytes"] == [array["bytes"] // 4] * 4, name
        else:
            assert "norm" in name or "router" in name, name  # replicated: only the small ones
    assert placed["model.layers.0.self_attn.qkv_proj.kernel"]["spec"] == [None, "model"]
    total = sum(a["bytes"] for a in placed.values())
    largest = max(a["bytes"] for a in placed.values())
    assert streamed["tensors"] >= len(placed) - 1  # every tensor went through the counter
    # A fused projection's parts and the fused result at most; never the model.
    assert 0 < streamed["loader_peak"] <= 2 * largest, (streamed["loader_peak"], largest)
    assert streamed["loader_peak"] * 4 < total


@pytest.mark.parametrize("tp", ["1", "4"])
def test_a_checkpoint_written_at_two_way_restores_as_the_source_loads(report, tp):
    restored = report["restored"][tp]
    assert restored["same_structure"]
    for name, array in restored["arrays"].items():
        assert array["equal"] and array["same_sharding"], name  # bit for bit, same shards
        if tp == "4" and array["spec"]:
            assert array["device_bytes"] == [array["bytes"] // 4] * 4, name
    assert restored["tokens"] == restored["source_tokens"]
    qkv = restored["arrays"]["model.layers.0.self_attn.qkv_proj.kernel"]
    # 4 query heads and, at TP=4, each of the 2 KV heads twice (k and v): 8 or 12 heads of 16.
    assert qkv["bytes"] == 64 * 16 * (8 if tp == "1" else 12) * 4


def test_a_damaged_checkpoint_restored_at_another_tp_size_is_an_error_naming_it(report):
    assert "cannot be served" in report["damaged"] and "unreadable arrays" in report["damaged"]
