# SPDX-License-Identifier: Apache-2.0
"""Two "hosts" on this machine for the multi-host tests: each a `vllm-xla serve` process (its own
session, 2 simulated CPU devices, its own cache directory) started with vLLM's multi-node options,
as a pod's hosts are; host 0 serves vLLM's OpenAI API, host 1 runs `--headless`.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.xla_flags import with_host_devices

DEVICES_PER_HOST = 2


def free_port() -> int:
    """A port nothing listens on now (and, for vLLM's store, the one after it for JAX's)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port + 1)) != 0 and port < 65000:
                return port


def host_environment(cache_dir: pathlib.Path) -> dict[str, str]:
    env = {
        **os.environ,
        "XLA_FLAGS": with_host_devices(DEVICES_PER_HOST),
        "JAX_PLATFORMS": "cpu",
        "VLLM_XLA_PLATFORM": "cpu",
        "VLLM_XLA_CACHE_DIR": str(cache_dir),
        "VLLM_XLA_ATTENTION_BACKEND": "xla",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's own engine process, as served
    return env


def start_host(
    rank: int, model: str, options: list[str], master_port: int, tmp: pathlib.Path, http_port: int | None
) -> tuple[subprocess.Popen, pathlib.Path]:
    """`vllm-xla serve` as host `rank` of 2; its process and log file."""
    log = tmp / f"host{rank}.log"
    argv = [sys.executable, "-m", "plugin_shim.cli", "serve", "--model", model, *options]
    argv += ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
    argv += ["--master-port", str(master_port)]
    argv += ["--headless"] if http_port is None else ["--port", str(http_port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, env=host_environment(tmp / f"cache{rank}"), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # the host's whole process tree is one group to kill
        )  # fmt: skip
    return proc, log


def start_replica_host(
    rank: int,
    model: str,
    options: list[str],
    rpc_port: int,
    tmp: pathlib.Path,
    http_port: int | None,
    *,
    launch: str = "headless",
) -> tuple[subprocess.Popen, pathlib.Path]:
    """`vllm-xla serve` as host `rank` of 2 with vLLM's multi-node data-parallel options, by
    `launch`: "headless" (one replica a host; rank 0 serves the OpenAI API on `http_port`, rank 1
    runs `--headless` and joins rank 0's front end at `rpc_port`), "external" (vLLM's external
    load balancing: rank `rank` of 2 with its own API server on `http_port`) or "hybrid" (two
    replicas a host, each host's API server on `http_port` over its own). Its process and log."""
    log = tmp / f"replica{rank}.log"
    argv = [sys.executable, "-m", "plugin_shim.cli", "serve", "--model", model, *options]
    argv += ["--data-parallel-address=127.0.0.1", f"--data-parallel-rpc-port={rpc_port}"]
    if launch == "external":
        argv += ["--data-parallel-size=2", f"--data-parallel-rank={rank}", "--port", str(http_port)]
    elif launch == "hybrid":
        argv += ["--data-parallel-size=4", "--data-parallel-size-local=2", "--port", str(http_port)]
        argv += [f"--data-parallel-start-rank={2 * rank}"]
    else:
        argv += ["--data-parallel-size=2", "--data-parallel-size-local=1"]
        argv += ["--headless", f"--data-parallel-start-rank={rank}"] if rank else ["--port", str(http_port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, env=host_environment(tmp / f"cache{rank}"), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return proc, log


def kill_host(proc: subprocess.Popen) -> None:
    """SIGKILL to the host's process group (its server, engine and worker), as a machine dies."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_healthy(port: int, procs: list[subprocess.Popen], logs: list[pathlib.Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:  # every host's log: the other host may have died first
                tails = "\n".join(f"--- {other.name}:\n{other.read_text()[-4000:]}" for other in logs)
                raise AssertionError(f"{log.name} exited {proc.returncode}:\n{tails}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise AssertionError(f"host 0 not healthy in {timeout} s:\n{logs[0].read_text()[-6000:]}")


def completions(port: int, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of token-id prompts in one request (served concurrently), as token ids."""
    body = {
        "model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        choices = sorted(json.load(response)["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def metric(port: int, name: str) -> float:
    """The sum of a Prometheus metric's samples on host 0's `/metrics`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and (line[len(name)] in "{ ")
    )


def run_jax_hosts(
    worker: str, argv_of_host: list[list[str]], *, env: dict[str, str], timeout: float
) -> list[dict]:
    """Runs `worker RANK PORT *argv` as one JAX host per entry of `argv_of_host` (processes on
    this machine joining at a free port) and returns each host's last `REPORT {json}` line, in
    host order; a host that fails or reports nothing fails the test with its output's tail."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(rank), port, *argv],
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd(), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, argv in enumerate(argv_of_host)
    ]
    reports = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
            assert proc.returncode == 0 and lines, out[-3000:]
            reports.append(json.loads(lines[-1].removeprefix("REPORT ")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return reports
