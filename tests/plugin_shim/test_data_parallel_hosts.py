# SPDX-License-Identifier: Apache-2.0
"""Data parallelism across hosts: two "hosts" on this machine (`multihost_launch`: a process each
with its own simulated CPU devices and cache), each running one replica of a dense model with
vLLM's multi-node data-parallel options, host 1 `--headless` and joined to host 0's OpenAI
server. Concurrent completions answer with transformers' greedy tokens and reach both replicas
(vLLM's per-engine request counters on host 0's `/metrics`). The hosts' liveness link ends one
host, non-zero, when the other is killed, either way round (the link's own cases, cheaply:
tests/tpu_platform/test_liveness.py)."""

from __future__ import annotations

import time

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
# The link's join bound: host 1 starts first and waits for host 0's server to import vLLM.
TIMEOUT_S = 120
SERVE = [
    "--max-model-len=64", "--max-num-seqs=4", "--max-num-batched-tokens=16",
    f"--distributed-timeout-seconds={TIMEOUT_S}",
]  # fmt: skip
# A killed process's sockets close at once: the survivor needs no silence bound, only its stop.
ENDED_WITHIN_S = 90
LOST = "vllm-xla serve: exiting with status 1: a data-parallel host was lost"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("dp_hosts") / "model"), seed=6)


def _start_hosts(model: str, tmp, options: list[str] = SERVE) -> dict:
    rpc, port = free_port(), free_port()
    host1, log1 = start_replica_host(1, model, options, rpc, tmp, None)
    host0, log0 = start_replica_host(0, model, options, rpc, tmp, port)
    hosts = {"port": port, "host0": host0, "host1": host1, "log0": log0, "log1": log1}
    try:
        wait_healthy(port, [host0, host1], [log0, log1], timeout=800)
    except BaseException:
        _kill(hosts)
        raise
    return hosts


def _kill(hosts: dict) -> None:
    kill_host(hosts["host0"])
    kill_host(hosts["host1"])


def _ends_with_the_lost_host_named(survivor, log) -> None:
    start = time.monotonic()
    code = survivor.wait(timeout=ENDED_WITHIN_S)
    text = log.read_text()
    assert code != 0, text[-4000:]
    assert time.monotonic() - start < ENDED_WITHIN_S
    assert LOST in text and "closed the link" in text, text[-4000:]


@pytest.fixture(scope="module")
def hosts(model, tmp_path_factory):
    hosts = _start_hosts(model, tmp_path_factory.mktemp("replicas"))
    yield hosts
    _kill(hosts)


def test_replicas_on_two_hosts_answer_with_transformers_tokens_and_share_the_requests(hosts, model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert completions(hosts["port"], model, PROMPTS, NEW_TOKENS) == want
    served = _requests_per_engine(get(f"http://127.0.0.1:{hosts['port']}/metrics", timeout=30).decode())
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    assert sum(served.values()) == len(PROMPTS)


def test_killing_the_headless_host_ends_host_0(hosts):
    """Runs after the served test: it ends the hosts."""
    kill_host(hosts["host1"])
    _ends_with_the_lost_host_named(hosts["host0"], hosts["log0"])


def test_hosts_of_two_replicas_each_behind_their_own_server_answer_and_end_together(model, tmp_path):
    """vLLM's hybrid load balancing: each host's API server over its own two replicas (4 in all),
    a load balancer (here: the test) in front of the hosts; the servers are linked all the same."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    rpc, ports = free_port(), [free_port(), free_port()]
    started = [start_replica_host(r, model, SERVE, rpc, tmp_path, ports[r], launch="hybrid") for r in (1, 0)]
    procs, logs = [proc for proc, _ in started[::-1]], [log for _, log in started[::-1]]
    try:
        for port in ports:
            wait_healthy(port, procs, logs, timeout=800)
        half = len(PROMPTS) // 2
        for host, port in enumerate(ports):
            mine = PROMPTS[:half] if host == 0 else PROMPTS[half:]
            assert completions(port, model, mine, NEW_TOKENS) == (want[:half] if host == 0 else want[half:])
            served = _requests_per_engine(get(f"http://127.0.0.1:{port}/metrics", timeout=30).decode())
            assert set(served) == {str(2 * host), str(2 * host + 1)}, served  # its own replicas only
        kill_host(procs[1])
        _ends_with_the_lost_host_named(procs[0], logs[0])
    finally:
        for proc in procs:
            kill_host(proc)


def test_killing_host_0_ends_the_headless_host(model, tmp_path):
    hosts = _start_hosts(model, tmp_path)
    try:
        kill_host(hosts["host0"])
        _ends_with_the_lost_host_named(hosts["host1"], hosts["log1"])
    finally:
        _kill(hosts)
