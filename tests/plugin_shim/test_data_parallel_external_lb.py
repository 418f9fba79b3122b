# SPDX-License-Identifier: Apache-2.0
"""Data-parallel replicas started one by one (vLLM's external load balancing, one API server a
rank, as a wide-EP deployment runs a pod a rank): two `vllm-xla serve` processes on this machine
(`multihost_launch`: each its own simulated CPU devices and cache), ranks 0 and 1 of a tiny
Qwen3-MoE with `--data-parallel-rank` and `--enable-expert-parallel`. The ranks' engines join
one JAX job and run one step program with the experts split over them
(`tpu_platform.replica_step`); each rank's own server answers with transformers' greedy tokens
(the other rank taking its part by vLLM's dummy batches), and killing rank 1 ends rank 0,
non-zero, by the replicas' liveness link (`plugin_shim.vllm_serve`). The rules that pick which
process listens, and what is refused without the link: test_data_parallel_config.py,
test_feature_check.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import save_tiny
from tests.plugin_shim.multihost_launch import (
    completions,
    free_port,
    kill_host,
    start_replica_host,
    wait_healthy,
)
from tests.plugin_shim.test_data_parallel_hosts import (
    NEW_TOKENS,
    PROMPTS,
    SERVE,
    _ends_with_the_lost_host_named,
)

pytestmark = pytest.mark.slow  # two servers joined in one JAX job, both warming up


def test_ranks_started_one_by_one_answer_on_their_own_servers_and_end_together(tmp_path):
    from transformers import AutoModelForCausalLM

    model = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "model"), seed=7)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    rpc, ports = free_port(), [free_port(), free_port()]
    options = [*SERVE, "--enable-expert-parallel"]
    ranks = [
        start_replica_host(r, model, options, rpc, tmp_path, ports[r], launch="external") for r in (1, 0)
    ][::-1]
    procs, logs = [proc for proc, _ in ranks], [log for _, log in ranks]
    try:
        for port in ports:
            wait_healthy(port, procs, logs, timeout=800)
        half = len(PROMPTS) // 2
        with ThreadPoolExecutor(2) as pool:  # both ranks busy at once, then one alone
            both = list(
                pool.map(completions, ports, [model] * 2, [PROMPTS[:half], PROMPTS[half:]], [NEW_TOKENS] * 2)
            )
        alone = completions(ports[1], model, PROMPTS[:1], NEW_TOKENS)
        for log in logs:
            assert "experts by index over 2 data-parallel replicas" in log.read_text()
        kill_host(procs[1])
        _ends_with_the_lost_host_named(procs[0], logs[0])
    finally:
        for proc in procs:
            kill_host(proc)
    assert both[0] + both[1] == want
    assert alone == want[:1]
