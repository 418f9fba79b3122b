# SPDX-License-Identifier: Apache-2.0
"""The `serve` workload of `throughput.py`: vLLM's OpenAI server under concurrent streaming clients.

The server is `python -m vllm.entrypoints.openai.api_server` on a free loopback port, started in
its own process group with the peer's environment (inherited from the worker; on our platform
its engine process is forked, as `vllm-xla serve` does; vLLM's CPU backend spawns its). After `/health`
answers and one warm-up request, `concurrency` clients share `requests` streaming
`/v1/completions` calls (token-id prompts, greedy, `ignore_eos`). Measured per request: time to
first token (TTFT), the gaps between streamed tokens (ITL) and time per output token after the
first (TPOT). Then the server's own `/metrics` split each request's time on the engine's side
(vLLM's histograms: waiting in the queue, prefill, decode; means over the run, the warm-up request
included) and give our `vllm_xla:*` gauges when our platform serves. The server is then stopped:
SIGTERM to its group, SIGKILL if still alive after 30 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from _peers import SEED, VLLM_LIMITS, Sizes, quantization_of, random_prompts, vocab_size

HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 300.0
COMPILE_AFTER_WARMUP = "compiled a new program after warm-up"  # our runner's warning (tpu_platform)
# vLLM's per-request histograms (seconds): where a request's time goes on the engine's side.
ENGINE_HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def server_command(
    model_dir: str, port: int, dtype: str, kv_cache_dtype: str = "auto", quantization: str | None = None
) -> list[str]:
    limits = [f"--{k.replace('_', '-')}={v}" for k, v in VLLM_LIMITS.items()]
    quantized = ["--quantization", quantization] if quantization else []
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", "bench", "--host", HOST, "--port", str(port), "--dtype", dtype,
        "--kv-cache-dtype", kv_cache_dtype, "--seed", str(SEED), "--disable-uvicorn-access-log", *limits,
        *quantized,
    ]  # fmt: skip


def start_server(command: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (EngineCore included), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


async def wait_healthy(session, base: str, proc: subprocess.Popen, timeout: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before /health answered")
        try:
            async with session.get(f"{base}/health") as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(1.0)
    raise TimeoutError(f"/health did not answer within {timeout:.0f} s")


async def stream_one(session, base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion: TTFT, the gap per streamed token and the token count."""
    body = {
        "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    start = time.perf_counter()
    last, tokens, ttft, gaps = start, 0, None, []
    async with session.post(f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            usage = chunk.get("usage")
            if usage:
                count = int(usage.get("completion_tokens") or tokens)
            else:  # no per-chunk usage: one streamed text piece counts as one token
                count = tokens + sum(1 for c in chunk.get("choices", []) if c.get("text"))
            if count <= tokens:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                gaps.extend([(now - last) / (count - tokens)] * (count - tokens))
            last, tokens = now, count
    latency = last - start
    tpot = (latency - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens, "latency": latency, "tpot": tpot}


async def run_clients(base: str, prompts: list[list[int]], max_tokens: int, concurrency: int, proc):
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        await wait_healthy(session, base, proc)
        health_seconds = time.perf_counter() - started
        warm = time.perf_counter()
        await stream_one(session, base, prompts[0][:16], 8)
        warm_seconds = time.perf_counter() - warm
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        results: list[dict[str, Any]] = []

        async def client() -> None:
            while not queue.empty():
                results.append(await stream_one(session, base, queue.get_nowait(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        async with session.get(f"{base}/metrics") as response:
            metrics = engine_metrics(await response.text())
    return health_seconds, warm_seconds, wall, results, metrics


def engine_metrics(text: str) -> dict[str, Any]:
    """Means (ms) of vLLM's per-request histograms and the `vllm_xla:*` gauges, from `/metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}  # "<histogram>_sum" / "<histogram>_count", summed over labels
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm_xla:"):
                gauges[sample.name] = sample.value
            elif sample.name.endswith(("_sum", "_count")):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    means = {
        label: 1000.0 * totals[f"{name}_sum"] / totals[f"{name}_count"]
        for label, name in ENGINE_HISTOGRAMS.items()
        if totals.get(f"{name}_count")
    }
    return {"engine_mean_ms": means, "platform_gauges": gauges}


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99, mean and max, in milliseconds by default."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    arr = np.asarray(values) * scale
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "mean": float(arr.mean()),
        "max": float(arr.max()),
    }


def summarize(wall: float, results: list[dict[str, Any]], prompts: list[list[int]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "requests": len(results),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": tokens,
        "seconds": wall,
        "output_tok_s": tokens / wall,
        "requests_per_s": len(results) / wall,
        "ttft_ms": percentiles([r["ttft"] for r in results if r["ttft"] is not None]),
        "itl_ms": percentiles(gaps),
        # Gaps behind a step that prefills a full token budget: the clients arrive in waves (each
        # starts its next request as its last ends), so about 1% of the gaps are such stalls in any
        # engine and the ITL p99 lands on one side of them or the other from run to run.
        "itl_gaps_over_1s": int(sum(g > 1.0 for g in gaps)),
        "tpot_ms": percentiles([r["tpot"] for r in results if r["tpot"] is not None]),
    }


def run_serve(
    peer: str, model_dir: str, dtype: str, sizes: Sizes, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    """Starts the server, drives the clients, stops the server; raises with the log tail on failure."""
    port = free_port()
    command = server_command(model_dir, port, dtype, kv_cache_dtype, quantization_of(peer))
    prompts = random_prompts(sizes.serve_requests, sizes.serve_prompt_len, vocab_size(model_dir), SEED + 3)
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = start_server(command, log)
        try:
            health, warm, wall, results, metrics = asyncio.run(
                run_clients(
                    f"http://{HOST}:{port}", prompts, sizes.serve_output, sizes.serve_concurrency, proc
                )
            )
        except BaseException as error:
            stop_server(proc)
            log.seek(0)
            raise RuntimeError(f"serve failed ({error!r}); server log tail:\n{log.read()[-4000:]}") from error
        stop_server(proc)
        log.seek(0)
        server_log = log.read()
    sys.stderr.write(f"--- server log ---\n{server_log}\n")  # kept in the worker's log file
    result = {
        "dtype": dtype,
        "engine_mode": "OpenAI server (AsyncLLM + EngineCore process)",
        "command": command,
        "startup_seconds": health,
        "warmup_seconds": warm,
        "concurrency": sizes.serve_concurrency,
        "expected_output_tokens": sizes.serve_output * sizes.serve_requests,
        "compiles_after_warmup_logged": server_log.count(COMPILE_AFTER_WARMUP),
    }
    result.update(summarize(wall, results, prompts))
    result.update(metrics)
    return result
