# SPDX-License-Identifier: Apache-2.0
"""Soak: `vllm-xla serve` under minutes of mixed and hostile traffic, then a check that it is still whole.

The server (the embedded model, on 127.0.0.1 only) takes `--clients` concurrent clients, more
than its `--max-num-seqs`, plus a burst of three times that many every `--burst-every` seconds,
for `--minutes`, at most `--max-requests` requests. Each request draws its kind:

- 5%: malformed or invalid (broken JSON, a negative `max_tokens`, a temperature below 0, an
  unknown model, a prompt longer than the model's length, a missing prompt): must get a 4xx;
- else a completion or chat completion with a random prompt length and random sampling options
  (greedy or temperature, top-k, top-p, min-p, penalties, a seed, stop strings), streamed or not;
  20% of the streamed ones drop the connection after a few chunks;
- with LoRA (unless `--no-lora`): 30% of the valid requests name one of the LoRA adapters that
  are loaded at the time, while adapters are loaded and unloaded every `--lora-every` seconds
  (`benchmarks/_soak_hostile.py`; a request that races an unload may get a 404).

Then the hostile phase (`_soak_hostile.py`): a 5000-entry `logit_bias` and a NaN adapter and
a catastrophic-regex adapter (each must be refused with a 4xx), `prompt_logprobs` 0..5 (served),
each followed by a greedy probe of the base model that must answer with its first text.

Sampled every `--sample-every` seconds: resident memory of the server and its engine process, and
from `/metrics` the KV-cache usage, running and waiting requests and `vllm_xla:*` counters. At
the end, once idle: KV usage (must be back to 0), compilations after warm-up (must be 0),
`/health`, and a last probe (the engine alive). Printed and written as JSON (`--out`, the
server's log beside it): requests by kind and status, 5xx count (must be 0), memory at the start,
over time and at the end, its growth after the first minute (a third of the run when shorter),
the hostile steps and a verdict per check. Loopback only; bounded by `--minutes`,
`--max-requests` and per-request timeouts (`--quick`: a one-minute run of at most 120 requests).

    python benchmarks/soak.py --minutes 10 --out benchmarks/results/soak.json
    python benchmarks/soak.py --quick --out benchmarks/results/soak-quick.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from _serve import HOST, free_port, start_server, stop_server, wait_healthy
from _soak_hostile import (
    LORA_SERVER_ARGS,
    NAN_REFUSAL,
    LoraTraffic,
    hostile_phase,
    probe,
    write_hostile_adapters,
    write_lora_adapters,
)
from _soak_requests import MODEL_NAME, invalid_request, valid_request
from _soak_watch import health, rss_growth, sampler, scrape_or_error, wait_idle

MALFORMED_SHARE = 0.05
DROP_SHARE = 0.2  # of the streamed requests
LORA_SHARE = 0.3  # of the valid requests, while an adapter is loaded


def cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "vllm-xla")


def server_command(port: int, args: argparse.Namespace) -> list[str]:
    return [
        cli(),
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--disable-uvicorn-access-log",
        *([] if args.no_lora else LORA_SERVER_ARGS),
    ]


class Tally:
    """Requests by kind and outcome; outcome is the HTTP status, "dropped" or an error name."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.tokens = 0

    def add(self, kind: str, outcome: str) -> None:
        self.counts[(kind, outcome)] += 1

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.counts.items()):
            out.setdefault(kind, {})[outcome] = n
        return out

    def statuses(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for (_, outcome), n in self.counts.items():
            total[outcome] += n
        return total


async def one_request(session, base: str, rng: random.Random, args, tally: Tally, lora=None) -> None:
    import aiohttp

    if rng.random() < MALFORMED_SHARE:
        kind, path, raw = invalid_request(rng, args.max_model_len)
        headers = {"Content-Type": "application/json"}
        try:
            async with session.post(base + path, data=raw, headers=headers) as response:
                await response.read()
                tally.add(f"invalid:{kind}", str(response.status))
        except (TimeoutError, aiohttp.ClientError) as error:
            tally.add(f"invalid:{kind}", type(error).__name__)
        return
    kind, path, body, stream = valid_request(rng, args.max_model_len)
    adapter = lora.pick(rng) if lora is not None and rng.random() < LORA_SHARE else None
    if adapter is not None:
        body["model"], kind = adapter, f"lora:{kind}"
    drop_after = rng.randint(1, 4) if stream and rng.random() < DROP_SHARE else None
    kind = f"{kind}:{'stream' if stream else 'whole'}"
    try:
        async with session.post(base + path, json=body) as response:
            if response.status != 200 or not stream:
                await response.read()
                tally.add(kind, str(response.status))
                return
            chunks = 0
            async for line in response.content:
                if line.startswith(b"data:"):
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        response.close()  # the client goes away mid-stream
                        tally.add(kind, "dropped")
                        return
            tally.add(kind, str(response.status))
    except (TimeoutError, aiohttp.ClientError) as error:
        tally.add(kind, type(error).__name__)


async def traffic(session, base: str, args, tally: Tally, deadline: float, lora=None) -> int:
    """Runs the clients and the bursts until `deadline` or `--max-requests`; returns how many went."""
    rng = random.Random(args.seed)
    budget = [args.max_requests]

    def take() -> bool:
        if budget[0] <= 0 or time.monotonic() >= deadline:
            return False
        budget[0] -= 1
        return True

    async def client(seed: int) -> None:
        local = random.Random(seed)
        while take():
            await one_request(session, base, local, args, tally, lora)

    async def bursts() -> None:
        while time.monotonic() + args.burst_every < deadline:
            await asyncio.sleep(args.burst_every)
            burst = [
                one_request(session, base, random.Random(rng.random()), args, tally, lora)
                for _ in range(3 * args.max_num_seqs)
                if take()
            ]
            await asyncio.gather(*burst)

    clients = [client(rng.randrange(2**31)) for _ in range(args.clients)]
    if lora is not None:
        clients.append(lora.cycle(session, base, tally, deadline, args.lora_every, args.seed))
    await asyncio.gather(bursts(), *clients)
    return args.max_requests - budget[0]


async def soak(args, port: int, proc, adapters: dict[str, dict[str, str]]) -> dict[str, Any]:
    import aiohttp

    base = f"http://{HOST}:{port}"
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # The server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds; a client that
    # keeps it longer may send a request on a socket the server is closing (a connection reset on
    # a valid request, the client's race, not the server's failure). Reuse only well inside that.
    keep_alive = max(0.5, float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")) / 2)
    connector = aiohttp.TCPConnector(keepalive_timeout=keep_alive)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()
        await wait_healthy(session, base, proc, args.startup_timeout)
        startup = time.monotonic() - started
        warm = Tally()  # a few of each kind first: the programs warm-up missed would show here
        for seed in range(4):
            await one_request(session, base, random.Random(seed), args, warm)
        warm_metrics = await scrape_or_error(session, base)
        tally, samples, stop = Tally(), [], asyncio.Event()
        lora = LoraTraffic(adapters["lora"]) if adapters else None
        t0 = time.monotonic()
        sampling = asyncio.create_task(sampler(session, base, proc.pid, args.sample_every, samples, stop, t0))
        sent = await traffic(session, base, args, tally, t0 + 60 * args.minutes, lora)
        traffic_seconds = time.monotonic() - t0
        hostile = await hostile_phase(
            session, base, MODEL_NAME, adapters.get("hostile", {}), rounds=args.hostile_rounds,
            timeout=args.hostile_timeout,
        )  # fmt: skip
        idle = await wait_idle(session, base, timeout=120)
        stop.set()
        await sampling
        healthy = await health(session, base)
        alive = await probe(session, base, MODEL_NAME, args.hostile_timeout) is not None
    return {
        "startup_seconds": startup,
        "warmup_metrics": warm_metrics,
        "traffic_seconds": traffic_seconds,
        "requests_sent": sent,
        "tally": tally,
        "samples": samples,
        "hostile": hostile,
        "idle_metrics": idle,
        "healthy": healthy,
        "engine_alive_at_end": alive,
    }


def _unexpected_tracebacks(log: str) -> int:
    """Tracebacks in the server's log but those vLLM's engine logs for an adapter load we refused
    (its `add_lora` utility call re-raises our refusal: the hostile phase's NaN adapter)."""
    blocks = log.split("Traceback (most recent call last)")[1:]
    return sum(1 for block in blocks if NAN_REFUSAL not in block)


def report(run: dict[str, Any], args, command: list[str], served_log: str) -> dict[str, Any]:
    """The figures and checks of a run; `served_log` is the server's log up to its shutdown."""
    tally: Tally = run.pop("tally")
    statuses = tally.statuses()
    server_errors = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    invalid_not_4xx = sum(
        n for (kind, s), n in tally.counts.items() if kind.startswith("invalid:") and not s.startswith("4")
    )
    valid_failed = sum(
        n
        for (kind, s), n in tally.counts.items()
        if not kind.startswith("invalid:") and s not in ("200", "dropped") and not _lora_race(kind, s)
    )
    idle = run["idle_metrics"]
    growth = rss_growth(run["samples"], min(60.0, run["traffic_seconds"] / 3))
    hostile = run["hostile"]
    server_errors += sum(s["outcome"].startswith("5") for s in hostile["steps"])
    compiles_after = idle.get("vllm_xla:compilations_after_warmup")
    checks = {
        "no_5xx": server_errors == 0,
        "invalid_requests_get_4xx": invalid_not_4xx == 0,
        "valid_requests_complete": valid_failed == 0,
        "kv_usage_back_to_0": idle.get("vllm:kv_cache_usage_perc") == 0,
        "no_compiles_after_warmup": compiles_after == 0,
        "healthy_at_end": run["healthy"],
        "engine_alive_at_end": run["engine_alive_at_end"],
        "hostile_steps_as_expected": hostile["all_expected"],
        "base_output_unchanged_by_hostile_steps": hostile["base_output_unchanged"],
        "no_tracebacks_while_serving": _unexpected_tracebacks(served_log) == 0,
        "rss_growth_under_5pct": bool(growth) and all(g["growth_pct"] < 5 for g in growth.values()),
    }
    return {
        "command": command,
        "minutes": args.minutes,
        "clients": args.clients,
        "max_num_seqs": args.max_num_seqs,
        "requests_by_kind": tally.by_kind(),
        "requests_by_status": dict(statuses),
        "server_errors_5xx": server_errors,
        "invalid_not_4xx": invalid_not_4xx,
        "valid_failed": valid_failed,
        "rss_start_mib": run["samples"][0]["rss_mib"] if run["samples"] else {},
        "rss_end_mib": run["samples"][-1]["rss_mib"] if run["samples"] else {},
        "rss_growth_after_first_minute": growth,
        "compilations_after_warmup": compiles_after,
        "server_log_tracebacks": served_log.count("Traceback"),
        "server_log_unexpected_tracebacks": _unexpected_tracebacks(served_log),
        "checks": checks,
        "passed": all(checks.values()),
        **run,
    }


def _lora_race(kind: str, outcome: str) -> bool:
    """A LoRA request whose adapter was unloaded before it arrived: the server's right answer."""
    return kind.startswith("lora:") and outcome == "404"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=12, help="concurrent clients (above --max-num-seqs)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-requests", type=int, default=5000, help="upper bound on requests sent")
    p.add_argument("--burst-every", type=float, default=90.0, help="seconds between bursts")
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/soak.json")
    p.add_argument("--no-lora", action="store_true", help="no LoRA traffic and no adapter steps")
    p.add_argument("--lora-every", type=float, default=5.0, help="seconds between adapter loads")
    p.add_argument("--hostile-rounds", type=int, default=2, help="prompt_logprobs 0..5 cycles")
    p.add_argument("--hostile-timeout", type=float, default=120.0, help="seconds per hostile request")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--quick", action="store_true", help="a short run: see the module docstring")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.max_requests, args.clients = 1.0, 120, 10
        args.burst_every, args.sample_every, args.hostile_rounds, args.hostile_timeout = 20.0, 5.0, 1, 60.0
    return args


def write_adapters(root: str) -> dict[str, dict[str, str]]:
    """The LoRA traffic's and the hostile steps' adapters, for the embedded model."""
    model_dir = subprocess.run([cli(), "model-dir"], capture_output=True, text=True, check=True)
    model_dir = model_dir.stdout.strip().splitlines()[-1]
    return {"lora": write_lora_adapters(model_dir, root), "hostile": write_hostile_adapters(model_dir, root)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    command = server_command(port, args)
    if not args.no_lora:  # adapters loaded and unloaded while serving
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    with tempfile.TemporaryFile(mode="w+") as log, tempfile.TemporaryDirectory() as root:
        adapters = {} if args.no_lora else write_adapters(root)
        proc = start_server(command, log)
        try:
            run = asyncio.run(soak(args, port, proc, adapters))
        except BaseException:
            stop_server(proc)
            log.seek(0)
            sys.stderr.write(f"--- server log tail ---\n{log.read()[-6000:]}\n")
            raise
        served_bytes = os.fstat(log.fileno()).st_size  # the log up to the shutdown
        stop_server(proc)
        log.seek(0)
        log_text = log.read()
    # vLLM's shutdown on SIGTERM logs the engine's end as an error with a traceback: only the
    # tracebacks before it count.
    served_log = log_text.encode()[:served_bytes].decode(errors="replace")
    result = report(run, args, command, served_log)
    result["server_log_tracebacks_at_shutdown"] = log_text.count("Traceback") - served_log.count("Traceback")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    server_log = os.path.splitext(args.out)[0] + ".server.log"
    with open(server_log, "w") as f:  # what a traceback or warning counted above came with
        f.write(log_text)
    result["server_log"] = server_log
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    result["hostile_outcomes"] = {s["step"]: s["outcome"] for s in result["hostile"]["steps"]}
    summary = {
        k: result[k]
        for k in (
            "requests_by_status",
            "server_errors_5xx",
            "invalid_not_4xx",
            "valid_failed",
            "compilations_after_warmup",
            "rss_start_mib",
            "rss_end_mib",
            "rss_growth_after_first_minute",
            "hostile_outcomes",
            "checks",
        )
    }
    print(json.dumps(summary, indent=2))
    print(f"written: {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
