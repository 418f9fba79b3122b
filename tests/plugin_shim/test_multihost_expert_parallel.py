# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism across two hosts, each a process on this machine with 2 simulated CPU
devices (`multihost_launch`, as `test_multihost.py` starts them): a tiny Qwen3-MoE served with
`--tensor-parallel-size 4 --enable-expert-parallel --nnodes 2`, so each of the 4 devices holds 2
of the 8 experts, 2 devices on each host, and each MoE layer's sum crosses the hosts. vLLM's
OpenAI server on host 0 answers with transformers' greedy tokens and the one-device model's.
"""

from __future__ import annotations

import pytest

from tests.models.tiny_checkpoints import prompts, save_tiny
from tests.plugin_shim.multihost_launch import completions, free_port, kill_host, start_host, wait_healthy

# Four vLLM processes and a JAX job across two of them: minutes on a busy machine, `make test-full`.
pytestmark = pytest.mark.full

NEW_TOKENS = 5
GREEDY = prompts([7, 12, 3], seed=11)
SERVE = [
    "--max-model-len=64",
    "--max-num-seqs=4",
    "--max-num-batched-tokens=32",
    "--block-size=16",
    "--num-gpu-blocks-override=16",
    "--tensor-parallel-size=4",
    "--enable-expert-parallel",
    "--distributed-timeout-seconds=60",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # 8 experts, 2 a device; 4 query and 2 KV heads (repeated at TP=4); layer 1 a dense MLP
    return save_tiny("Qwen3MoeForCausalLM", str(tmp_path_factory.mktemp("ep_hosts") / "model"), seed=2)


@pytest.fixture(scope="module")
def transformers_tokens(model) -> list[list[int]]:
    import transformers

    from tests.greedy_reference import hf_greedy

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype="float32").eval()
    return [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in GREEDY]


@pytest.fixture(scope="module")
def one_device_tokens(model) -> list[list[int]]:
    """The same checkpoint on one device, no expert parallelism (`models`, in this process)."""
    import jax

    from models import ModelConfig
    from tests.tpu_platform.tensor_parallel_weights_worker import greedy
    from tpu_platform.weights.preparation import Preparation
    from tpu_platform.weights.prepared import load_prepared

    config = ModelConfig.from_pretrained(model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, loaded = load_prepared(model, Preparation("float32", tp_size=1), device)
    return [greedy(loaded, config, 1, prompt, NEW_TOKENS) for prompt in GREEDY]


@pytest.fixture(scope="module")
def hosts(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hosts")
    master, port = free_port(), free_port()
    started = [start_host(1, model, SERVE, master, tmp, None), start_host(0, model, SERVE, master, tmp, port)]
    procs, logs = [p for p, _ in started], [log for _, log in started]
    try:
        wait_healthy(port, procs[::-1], logs[::-1], timeout=800)
        yield {"port": port, "log0": logs[1], "log1": logs[0]}
    finally:
        for proc in procs:
            kill_host(proc)


def test_experts_split_over_two_hosts_answer_with_transformers_tokens(
    hosts, model, transformers_tokens, one_device_tokens
):
    assert one_device_tokens == transformers_tokens
    assert completions(hosts["port"], model, GREEDY, NEW_TOKENS) == transformers_tokens
    log0, log1 = hosts["log0"].read_text(), hosts["log1"].read_text()
    assert "drives JAX devices: cpu:0, cpu:1 (of 4 on 2 hosts)" in log0
    for log in (log0, log1):  # both hosts' runners placed the experts by index
        assert "x4 (tensor parallel, experts by index)" in log, log[-3000:]
