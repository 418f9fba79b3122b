# SPDX-License-Identifier: Apache-2.0
"""Host time per engine step at 64 running decode requests, with the device's work kept off the
engine's core: what a TPU or GPU host sees, approximated on a CPU.

    .venv/bin/python benchmarks/host_overhead.py [--out benchmarks/out/host_overhead.json]
        [--modes async,sync] [--repeats 3] [--no-pin] [--tp 1,2,4,8]

On a CPU the "device" is the host's own cores: XLA's threads run the forward on the cores, and
through the caches, that the engine's Python code then needs, so `vllm_xla:host_seconds_per_step`
measured while serving the embedded model on CPU (`throughput.py` prints it) includes that
contention. This script measures our host path as it runs beside an accelerator:

- the model has the embedded SmolLM2-135M's structure and argument count (30 layers, its tokenizer,
  one program argument per weight) but a 64-wide trunk and the tokenizer's first 8192 ids as its
  vocabulary (random weights, built once in `<VLLM_XLA_CACHE_DIR>/models/`), so a forward step
  takes milliseconds, not a hundred, and leaves the shared last-level cache mostly alone;
- XLA's threads run on every CPU but the first, the engine's thread (vLLM's scheduler and output
  processing, and all of our host work) on the first (`--no-pin`: all threads on all CPUs).

Each mode runs in its own subprocess: vLLM's `LLM` in-process, 64 prompts of 16 random token ids,
128 greedy tokens each (`ignore_eos`): one 1024-token prefill step, then 127 decode steps of 64
rows; `--repeats` timed runs after a warm-up request. `async`: vLLM's async scheduling (its
default: step N+1 is prepared while step N runs); `sync`: `async_scheduling=False`. Reported per
run, from the runner's counters (the stat logger's `vllm_xla:host_seconds_per_step`): host ms per
step (batch update in to dispatch, plus recording the tokens and building vLLM's output), of it
the runtime's calls (`vllm_xla:dispatch_seconds_per_step`: the input transfer and the execute
calls), the time from dispatch to the step's tokens on the host, and the wall time per step of
the whole engine (vLLM's scheduler included).

`--tp 1,2,4,8` runs each mode at those `tensor_parallel_size`s on 8 simulated CPU devices
(`--xla_force_host_platform_device_count`), on a variant of the thin model with 8 attention heads
of 8 (so every size splits it): what a sharded dispatch costs the host next to one device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _peers  # noqa: E402
import throughput  # noqa: E402

MODES = ("async", "sync")
THIN_WIDTH = 64  # hidden size; one attention head of 64, MLP 2x wide
TP_HEADS = 8  # attention heads (and KV heads) of the `--tp` variant
SIMULATED_DEVICES = 8
# The first 8192 of the tokenizer's ids: the tied embedding and head then take 2 MiB, not 12, so
# the device's step does not flush the last-level cache the engine's thread shares with it.
THIN_VOCAB = 8192
PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 16, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path (default benchmarks/out/host_overhead.json)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of async, sync")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode")
    parser.add_argument("--no-pin", action="store_true", help="leave every thread on every CPU")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mode")
    parser.add_argument("--tp", help="comma list of tensor_parallel_size (simulated CPU devices)")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def thin_model_dir(gguf_dir: str, heads: int = 1) -> str:
    """The embedded model's structure with a `THIN_WIDTH`-wide trunk of `heads` attention (and
    KV) heads: random float32 weights, its config otherwise, its tokenizer (built once)."""
    name = f"SmolLM2-135M-thin{THIN_WIDTH}-v{THIN_VOCAB}" + (f"-h{heads}" if heads > 1 else "")
    target = os.path.join(_peers.cache_dir(), "models", name)
    if os.path.exists(os.path.join(target, ".complete")):
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(os.path.join(gguf_dir, "config.json")) as f:
        config = json.load(f)
    config.update(
        hidden_size=THIN_WIDTH,
        intermediate_size=2 * THIN_WIDTH,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=THIN_WIDTH // heads,
        vocab_size=THIN_VOCAB,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config)).to(torch.float32)
    return _peers.save_model_dir(model, target, gguf_dir)


# ---------------------------------------------------------------------------------------------
# Worker side (one mode, in its own process)


def _cpu_split(pin: bool) -> tuple[set[int], set[int]] | None:
    """(the engine thread's CPUs, everything else's), or None when not pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


def _thread_affinities() -> dict[str, int]:
    """How many of this process's threads may run on each CPU list."""
    counts: dict[str, int] = {}
    for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list"):
                cpus = line.split()[1]
                counts[cpus] = counts.get(cpus, 0) + 1
    return counts


def worker_main(args: argparse.Namespace) -> int:
    split = _cpu_split(not args.no_pin)
    if split:  # threads inherit their creator's CPUs: XLA's and vLLM's start on the device CPUs
        os.sched_setaffinity(0, split[1])
    # The host beside an accelerator runs vLLM's async scheduling, which our platform otherwise
    # turns off on the CPU device standing in for it here.
    os.environ["VLLM_XLA_CPU_ASYNC_SCHEDULING"] = "1"
    from vllm import LLM

    llm = LLM(
        model=args.model_dir,
        dtype="float32",
        seed=_peers.SEED,
        async_scheduling=args.worker == "async",
        tensor_parallel_size=args.tensor_parallel_size,
        **_peers.VLLM_LIMITS,
    )
    vocab = _peers.vocab_size(args.model_dir)
    prompts = _peers.random_prompts(PROMPTS, (PROMPT_LEN, PROMPT_LEN), vocab, _peers.SEED)
    _peers._vllm_generate(llm, prompts[:2], 8)  # warm-up
    if split:
        os.sched_setaffinity(0, split[0])  # this thread alone: the engine and our host path
    runs = [_timed_run(llm, prompts) for _ in range(args.repeats)]
    result = {
        "mode": args.worker,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pinned": bool(split),
        "engine_cpus": sorted(split[0]) if split else None,
        "thread_affinities": _thread_affinities(),
        "runs": runs,
        "compiles_after_warmup": llm.collective_rpc("runner_stats")[0]["compiles_after_warmup"],
    }
    print(throughput.RESULT_MARK + json.dumps(result), flush=True)
    return 0


def _timed_run(llm, prompts: list[list[int]]) -> dict[str, float]:
    before = llm.collective_rpc("runner_stats")[0]
    start = time.perf_counter()
    _, lengths = _peers._vllm_generate(llm, prompts, OUTPUT_LEN)
    wall = time.perf_counter() - start
    after = llm.collective_rpc("runner_stats")[0]
    counters = ("steps", "host_seconds", "dispatch_seconds", "step_seconds", "overlapped_steps")
    delta = {k: after[k] - before[k] for k in counters}
    steps = max(delta["steps"], 1)
    return {
        "steps": delta["steps"],
        "output_tokens": sum(lengths),
        "host_ms_per_step": 1e3 * delta["host_seconds"] / steps,
        "dispatch_ms_per_step": 1e3 * delta["dispatch_seconds"] / steps,  # of the host time
        "dispatch_to_tokens_ms": 1e3 * delta["step_seconds"] / steps,
        "engine_wall_ms_per_step": 1e3 * wall / steps,
        "overlapped_fraction": delta["overlapped_steps"] / steps,
    }


# ---------------------------------------------------------------------------------------------
# Parent side


def run_mode(
    args: argparse.Namespace, mode: str, model_dir: str, log: pathlib.Path, tp: int | None = None
) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "host_overhead.py"), "--worker", mode, "--model-dir", model_dir]
    command += ["--repeats", str(args.repeats)] + (["--no-pin"] if args.no_pin else [])
    env = throughput.peer_env("xla")
    if tp is not None:
        command += ["--tensor-parallel-size", str(tp)]
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={SIMULATED_DEVICES}".strip()
    try:
        proc = subprocess.run(
            command, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired as e:
        return {"status": "failed", "stderr_tail": f"timed out after {e.timeout:.0f} s"}
    log.write_text(f"$ {' '.join(command)}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    marked = [ln for ln in proc.stdout.splitlines() if ln.startswith(throughput.RESULT_MARK)]
    if proc.returncode != 0 or not marked:
        return {"status": "failed", "returncode": proc.returncode, "stderr_tail": proc.stderr[-4000:]}
    return {"status": "ok", "log": str(log), **json.loads(marked[-1][len(throughput.RESULT_MARK) :])}


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def format_table(results: dict[str, dict[str, Any]]) -> str:
    header = "mode      pinned  host ms/step (each run; median)"
    lines = [header.ljust(58) + "of it runtime calls  dispatch->tokens ms  engine ms/step  overlapped"]
    for mode, r in results.items():
        if r["status"] != "ok":
            lines.append(f"{mode:9s} FAILED (exit {r.get('returncode')}):\n    {r['stderr_tail'][-1500:]}")
            continue
        runs = r["runs"]
        each = " ".join(f"{run['host_ms_per_step']:.3f}" for run in runs)
        host = (
            f"{mode:9s} {'yes' if r['pinned'] else 'no':6s}  {each}; {_median(runs, 'host_ms_per_step'):.3f}"
        )
        lines.append(
            host.ljust(58)
            + f"{_median(runs, 'dispatch_ms_per_step'):19.3f}"
            + f"  {_median(runs, 'dispatch_to_tokens_ms'):19.1f}"
            + f"  {_median(runs, 'engine_wall_ms_per_step'):14.1f}"
            + f"  {100 * _median(runs, 'overlapped_fraction'):9.0f}%"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = sorted(set(modes) - set(MODES))
    if bad:
        sys.exit(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    if not args.no_pin and len(os.sched_getaffinity(0)) < 2:
        sys.exit("pinning needs at least 2 CPUs; run with --no-pin")
    out = pathlib.Path(args.out or HERE / "out" / "host_overhead.json")
    logs = out.with_name(out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    info = throughput.machine_info()
    sizes = [int(n) for n in args.tp.split(",")] if args.tp else [None]
    model_dir = thin_model_dir(_peers.gguf_model_dir(), TP_HEADS if args.tp else 1)
    results = {}
    for mode in modes:
        for tp in sizes:
            name = mode if tp is None else f"{mode}-tp{tp}"
            print(f"[{name}] running...", end="", flush=True)
            results[name] = run_mode(args, mode, model_dir, logs / f"{name}.log", tp)
            print(f" {results[name]['status']}", flush=True)
    config = {
        "prompts": PROMPTS, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
        "width": THIN_WIDTH, "vocab": THIN_VOCAB, "heads": TP_HEADS if args.tp else 1,
        "tensor_parallel_sizes": sizes if args.tp else None,
    }  # fmt: skip
    out.write_text(json.dumps({"machine": info, "config": config, "results": results}, indent=2))
    print("\n" + format_table(results) + f"\n\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
