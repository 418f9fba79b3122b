# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism across hosts is the one-host placement on the hosts' mesh: two JAX hosts
(processes on this machine, 2 simulated CPU devices each, gloo collectives) load a tiny Qwen3-MoE
with its 8 experts split by index over the 4 devices (`expert_parallel_hosts_worker.py`, the
runner's placement). Each host holds its own devices' experts only (0-3 on host 0, 4-7 on host
1, 2 a device) and reads only those experts' tensors from the checkpoint (every other tensor
whole), and both give transformers' greedy tokens and the one-device model's. The same
through `vllm-xla serve` on two hosts: `tests/plugin_shim/test_multihost_expert_parallel.py`
(`make test-full`)."""

import json
import os
import re

import pytest

from tests.models.counted_reads import tensor_bytes
from tests.models.tiny_checkpoints import prompts, save_tiny
from tests.plugin_shim.multihost_launch import run_jax_hosts
from tests.xla_flags import with_host_devices

pytestmark = pytest.mark.slow  # two JAX processes joining

WORKER = os.path.join(os.path.dirname(__file__), "expert_parallel_hosts_worker.py")
NEW_TOKENS = 4
PROMPTS = prompts([9, 9], seed=11)  # one length: one prefill program to compile


def _run_hosts(model: str) -> list[dict]:
    argv = [model, str(NEW_TOKENS), json.dumps(PROMPTS)]
    devices = {"XLA_FLAGS": with_host_devices(2)}
    return run_jax_hosts(WORKER, [argv, argv], env=devices, timeout=300)


def _transformers_tokens(model: str) -> list[list[int]]:
    import transformers

    from tests.greedy_reference import hf_greedy

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype="float32").eval()
    return [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]


def _one_device_tokens(model: str) -> list[list[int]]:
    """The same checkpoint on one device, no expert parallelism, in this process."""
    import jax

    from models import ModelConfig
    from tests.tpu_platform.tensor_parallel_weights_worker import greedy
    from tpu_platform.weights.preparation import Preparation
    from tpu_platform.weights.prepared import load_prepared

    config = ModelConfig.from_pretrained(model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, loaded = load_prepared(model, Preparation("float32", tp_size=1), device)
    return [greedy(loaded, config, 1, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    # 8 experts; 4 query and 2 KV heads (repeated at TP=4); layer 1 a dense MLP
    model = save_tiny("Qwen3MoeForCausalLM", str(tmp_path_factory.mktemp("ep_hosts") / "model"), seed=2)
    return {
        "hosts": _run_hosts(model),
        "transformers": _transformers_tokens(model),
        "one": _one_device_tokens(model),
        "sizes": tensor_bytes(model),
    }


def test_both_hosts_give_transformers_and_one_device_tokens(run):
    assert run["one"] == run["transformers"]
    for report in run["hosts"]:
        assert report["flagged"] == 2  # the two MoE layers compute by expert index
        assert report["tokens"] == run["transformers"]


def test_each_host_holds_only_its_own_devices_experts(run):
    host0, host1 = (report["experts"] for report in run["hosts"])
    assert host0.keys() == host1.keys() and len(host0) == 6  # gate, up, down of 2 MoE layers
    for name in host0:
        assert host0[name]["held"] == [[0, 1], [2, 3]], name
        assert host1[name]["held"] == [[4, 5], [6, 7]], name
        for share in host0[name]["shares"] + host1[name]["shares"]:
            assert share[0] == 2, name  # 2 whole experts a device


def _expert(name: str) -> int | None:
    match = re.search(r"\.experts\.(\d+)\.", name)
    return None if match is None else int(match.group(1))


def test_each_host_reads_only_its_own_devices_experts(run):
    """Counted outside the loader (`tests.models.counted_reads`): host 0 reads experts 0-3's
    tensors, host 1 4-7's, whole, and nothing of the others'."""
    sizes = run["sizes"]
    assert {_expert(name) for name in sizes} == {None, *range(8)}
    for host, report in enumerate(run["hosts"]):
        experts = {name: size for name, size in report["read"].items() if _expert(name) is not None}
        own = range(4 * host, 4 * host + 4)
        assert experts == {name: size for name, size in sizes.items() if _expert(name) in own}


def test_each_host_reads_only_its_own_share_of_a_split_weight(run):
    """Tensor-parallel across the hosts, a weight read as it is stored is read in the part its
    host's devices hold: half of the row-parallel o_proj and dense down_proj and of the
    vocab-parallel embedding and head a host (slice reads); the fused q/k/v and gate/up (built
    here in per-device blocks), the norms and the replicated routers whole, once a host."""
    sizes = run["sizes"]
    halves = set()
    for name, size in sizes.items():
        if _expert(name) is None:
            reads = [report["read"][name] for report in run["hosts"]]
            assert reads in ([size, size], [size // 2, size // 2]), name
            halves |= {name} if reads[0] < size else set()
    assert halves == {
        "model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight",
        *(f"model.layers.{i}.self_attn.o_proj.weight" for i in range(3)),
    }  # fmt: skip
