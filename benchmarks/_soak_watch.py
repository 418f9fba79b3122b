# SPDX-License-Identifier: Apache-2.0
"""What `soak.py` watches of the server while it runs: the resident memory of it and its
processes (`process_rss`, `rss_growth`), its `/metrics` (KV-cache usage, running and waiting
requests, `vllm_xla:*` counters) sampled on a period (`sampler`), its health, and when it is idle
again (`wait_idle`). A server that died is a finding: a failed scrape is recorded, not raised."""

from __future__ import annotations

import asyncio
import time
from typing import Any


def process_rss(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of the server process and of each process under it."""
    import psutil

    try:
        server = psutil.Process(pid)
        out = {"server": server.memory_info().rss / 2**20}
        for child in server.children(recursive=True):
            try:
                if child.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: holds no memory
                    continue
                out[f"{child.name()}:{child.pid}"] = child.memory_info().rss / 2**20
            except psutil.Error:
                continue
        return out
    except psutil.Error:
        return {}


def metric_values(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted or sample.name.startswith("vllm_xla:"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def scrape(session, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as response:
        return metric_values(await response.text())


async def scrape_or_error(session, base: str) -> dict[str, Any]:
    """`scrape`, or the error that stopped it (a server that died is a finding, not a crash)."""
    try:
        return await scrape(session, base)
    except Exception as error:  # noted, the soak goes on
        return {"error": repr(error)}


async def sampler(session, base: str, pid: int, every: float, samples: list, stop: asyncio.Event, t0):
    while not stop.is_set():
        metrics = await scrape_or_error(session, base)
        samples.append({"t": time.monotonic() - t0, "rss_mib": process_rss(pid), "metrics": metrics})
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def wait_idle(session, base: str, timeout: float) -> dict[str, float]:
    """The metrics once nothing runs or waits (vLLM's gauges update on its logging interval)."""
    deadline = time.monotonic() + timeout
    metrics: dict[str, float] = {}
    while time.monotonic() < deadline:
        metrics = await scrape_or_error(session, base)
        if "error" in metrics:
            return metrics
        idle = metrics.get("vllm:num_requests_running", 1) + metrics.get("vllm:num_requests_waiting", 1) == 0
        if idle and metrics.get("vllm:kv_cache_usage_perc", 1) == 0:
            return metrics
        await asyncio.sleep(2.0)
    return metrics


async def health(session, base: str) -> bool:
    import aiohttp

    try:
        async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=30)) as response:
            return response.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


def rss_growth(samples: list[dict], after_seconds: float) -> dict[str, dict[str, float]]:
    """Per process: RSS at the first sample after `after_seconds`, at the end, and the growth (%)."""
    later = [s for s in samples if s["t"] >= after_seconds and s["rss_mib"]]
    if len(later) < 2:
        return {}
    first, last = later[0]["rss_mib"], later[-1]["rss_mib"]
    return {
        name: {
            "after_1min_mib": first[name],
            "end_mib": last[name],
            "growth_pct": 100 * (last[name] / first[name] - 1),
        }
        for name in first
        if name in last and first[name] > 0
    }
