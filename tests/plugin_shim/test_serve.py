# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla serve` starts vLLM's OpenAI server on our platform (loopback only)."""

import os
import time

import pytest

from tests.plugin_shim.served import get, post, serving
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # starts a server


def _xla_metrics(base: str, make_traffic) -> dict[str, float]:
    """Our `vllm_xla:*` gauges from `/metrics`, once they report steps (traffic drives the logger)."""
    values: dict[str, float] = {}
    for _ in range(30):
        make_traffic()
        text = get(f"{base}/metrics").decode()
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm_xla:")
        }
        if values.get("vllm_xla:steps", 0) > 0:
            return values
        time.sleep(1.0)
    raise AssertionError(f"no vllm_xla:steps on /metrics, saw {values}")


def test_serve_answers_completions(tmp_path):
    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=1)
    # The real server layout, the engine process started as `vllm-xla serve` decides (forked),
    # not as an in-process engine of this test process left `VLLM_WORKER_MULTIPROC_METHOD`.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    args = [
        "--model",
        model_dir,
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
    ]
    with serving(args, env, tmp_path / "server.log", startup_seconds=300) as base:
        body = {"model": model_dir, "prompt": "hello world", "max_tokens": 6, "temperature": 0.0}
        first = post(f"{base}/v1/completions", {**body, "ignore_eos": True})
        second = post(f"{base}/v1/completions", {**body, "ignore_eos": True})
        assert first["usage"]["completion_tokens"] == 6
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # greedy is deterministic
        metrics = _xla_metrics(base, lambda: post(f"{base}/v1/completions", {**body, "max_tokens": 2}))
        assert metrics["vllm_xla:steps"] > 0  # the stat logger plugin exports the worker's counters
        assert metrics["vllm_xla:compilations"] > 0
        assert metrics["vllm_xla:compilations_after_warmup"] == 0
        assert 0 < metrics["vllm_xla:dispatch_seconds_per_step"] < metrics["vllm_xla:host_seconds_per_step"]
        log_text = (tmp_path / "server.log").read_text()
        assert "vllm-xla worker drives JAX devices" in log_text  # our worker ran the model
        assert "warm-up built" in log_text
