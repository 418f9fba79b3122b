# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism over data-parallel replicas across hosts: two "hosts" on this machine
(`multihost_launch`: a process each with its own simulated CPU devices and cache), each running
one replica of a tiny Qwen3-MoE (on one of its devices, or tensor-parallel on both) with vLLM's
multi-node data-parallel options and `--enable-expert-parallel`, host 1 `--headless`. The two
ranks' processes join one JAX job and run one step program, the experts split over the two hosts'
devices (`tpu_platform.replica_step`).
Concurrent completions answer with transformers' greedy tokens and reach both replicas, and
killing host 1 ends host 0, non-zero, by the hosts' liveness link."""

from __future__ import annotations

import pytest
import torch

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import save_tiny
from tests.plugin_shim.multihost_launch import completions, kill_host
from tests.plugin_shim.served import get
from tests.plugin_shim.test_data_parallel import _requests_per_engine
from tests.plugin_shim.test_data_parallel_hosts import (
    NEW_TOKENS,
    PROMPTS,
    SERVE,
    _ends_with_the_lost_host_named,
    _kill,
    _start_hosts,
)

pytestmark = pytest.mark.full  # two servers joined in one JAX job, both warming up


@pytest.mark.parametrize("tp", [1, 2], ids=["a_device_a_replica", "two_devices_a_replica"])
def test_replicas_across_hosts_with_the_experts_over_them_answer_and_end_together(tmp_path, tp):
    """`tp`: each host's replica on that many of its devices, tensor-parallel, the experts over
    every host's devices (2 x tp)."""
    from transformers import AutoModelForCausalLM

    model = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "model"), seed=7)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    options = [*SERVE, "--enable-expert-parallel", f"--tensor-parallel-size={tp}"]
    hosts = _start_hosts(model, tmp_path, options)
    try:
        assert completions(hosts["port"], model, PROMPTS, NEW_TOKENS) == want
        served = _requests_per_engine(get(f"http://127.0.0.1:{hosts['port']}/metrics", timeout=30).decode())
        assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
        for log in (hosts["log0"], hosts["log1"]):
            assert "experts by index over 2 data-parallel replicas" in log.read_text()
        kill_host(hosts["host1"])
        _ends_with_the_lost_host_named(hosts["host0"], hosts["log0"])
    finally:
        _kill(hosts)
