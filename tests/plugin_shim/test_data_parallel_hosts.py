# SPDX-License-Identifier: Apache-2.0
"""Data parallelism across hosts: two "hosts" on this machine (`multihost_launch`: a process each
with its own simulated CPU devices and cache), each running one replica of a dense model with
vLLM's multi-node data-parallel options, host 1 `--headless` and joined to host 0's OpenAI
server. Concurrent completions answer with transformers' greedy tokens and reach both replicas
(vLLM's per-engine request counters on host 0's `/metrics`)."""

from __future__ import annotations

import pytest
import torch

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts
from tests.plugin_shim.multihost_launch import (
    completions,
    free_port,
    kill_host,
    start_replica_host,
    wait_healthy,
)
from tests.plugin_shim.served import get
from tests.plugin_shim.test_data_parallel import _requests_per_engine
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.full  # two servers of two engine processes each, both warming up

NEW_TOKENS = 5
PROMPTS = prompts([5, 9, 3, 12, 7, 4, 10, 6], seed=11)
SERVE = ["--max-model-len=64", "--max-num-seqs=4", "--max-num-batched-tokens=16"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("dp_hosts") / "model"), seed=6)


@pytest.fixture(scope="module")
def hosts(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    rpc, port = free_port(), free_port()
    started = [
        start_replica_host(1, model, SERVE, rpc, tmp, None),
        start_replica_host(0, model, SERVE, rpc, tmp, port),
    ]
    procs, logs = [p for p, _ in started], [log for _, log in started]
    try:
        wait_healthy(port, procs[::-1], logs[::-1], timeout=800)
        yield port
    finally:
        for proc in procs:
            kill_host(proc)


def test_replicas_on_two_hosts_answer_with_transformers_tokens_and_share_the_requests(hosts, model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert completions(hosts, model, PROMPTS, NEW_TOKENS) == want
    served = _requests_per_engine(get(f"http://127.0.0.1:{hosts}/metrics", timeout=30).decode())
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    assert sum(served.values()) == len(PROMPTS)
