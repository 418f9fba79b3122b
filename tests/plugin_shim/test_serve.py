# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla serve` starts vLLM's OpenAI server on our platform (loopback only)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # starts a server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _xla_metrics(base: str, make_traffic) -> dict[str, float]:
    """Our `vllm_xla:*` gauges from `/metrics`, once they report steps (traffic drives the logger)."""
    values: dict[str, float] = {}
    for _ in range(30):
        make_traffic()
        text = _get(f"{base}/metrics").decode()
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
    port = _free_port()
    # The real server layout, the engine process started as `vllm-xla serve` decides (forked),
    # not as an in-process engine of this test process left `VLLM_WORKER_MULTIPROC_METHOD`.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    cli = os.path.join(os.path.dirname(sys.executable), "vllm-xla")
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [cli, "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if _get(f"{base}/health", timeout=2) is not None:
                    break
            except OSError:
                pass
            assert time.time() < deadline, "server did not become healthy"
            time.sleep(1)
        body = {"model": model_dir, "prompt": "hello world", "max_tokens": 6, "temperature": 0.0}
        first = _post(f"{base}/v1/completions", {**body, "ignore_eos": True})
        second = _post(f"{base}/v1/completions", {**body, "ignore_eos": True})
        assert first["usage"]["completion_tokens"] == 6
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # greedy is deterministic
        metrics = _xla_metrics(base, lambda: _post(f"{base}/v1/completions", {**body, "max_tokens": 2}))
        assert metrics["vllm_xla:steps"] > 0  # the stat logger plugin exports the worker's counters
        assert metrics["vllm_xla:compilations"] > 0
        assert metrics["vllm_xla:compilations_after_warmup"] == 0
        assert 0 < metrics["vllm_xla:dispatch_seconds_per_step"] < metrics["vllm_xla:host_seconds_per_step"]
        log_text = (tmp_path / "server.log").read_text()
        assert "vllm-xla worker drives JAX devices" in log_text  # our worker ran the model
        assert "warm-up built" in log_text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
