# SPDX-License-Identifier: Apache-2.0
"""CPU time of our host path per decode step, measured on the engine's thread: a figure the
machine's load barely moves (a busy neighbour delays the thread but does not add to its CPU time).

    .venv/bin/python benchmarks/host_cpu_time.py [--rows 64,256] [--steps 64] [--profile N]
        [--async-scheduling] [--model-dir DIR] [--out benchmarks/out/host_cpu_time.json]

Serves the thin model of `host_overhead.py` (the embedded model's structure at a 64-wide trunk,
so a step's device work is small) in-process with synchronous scheduling: `R` prompts of 16
random ids, `--steps` greedy tokens each, for each `R` of `--rows`. Every call vLLM makes into our
worker (`execute_model`, `sample_tokens`; the translation, `Runner.execute`, the sampler's
dispatch, recording the tokens and building vLLM's output) is timed with `time.thread_time`, the
engine thread's own CPU seconds: waiting for the device's tokens costs none. Reported: CPU ms per
decode step of R rows (the prefill steps left out), and with `--profile N` the N functions with
the most own CPU time inside those calls (cProfile; its overhead inflates Python-heavy code, so
read it for shares, not for absolute time).

`--async-scheduling` runs vLLM's async scheduling (as on an accelerator:
`VLLM_XLA_CPU_ASYNC_SCHEDULING=1`): each step is dispatched while the previous one computes the
token it feeds, and the step's output is built when vLLM asks for it (`_AsyncOutput.get_output`,
timed too).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
PROMPT_LEN = 16
# Host phases timed on their own (where the tree has them): (label, module, attribute path).
PHASES = (
    ("translate", "plugin_shim.translate", "step_update"),
    ("apply", "tpu_platform.runner", "Runner._apply"),
    ("prepare inputs", "tpu_platform.runner", "prepare_step"),
    ("sampler inputs", "tpu_platform.sampling", "SamplingBatch.prepare"),
    ("input transfer", "tpu_platform.internals", "device_put"),
    ("execute calls", "tpu_platform.internals", "execute"),
    ("record tokens", "tpu_platform.runner", "record_step"),
    ("vLLM output", "plugin_shim.translate", "model_runner_output"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256", help="comma list of decode batch sizes")
    parser.add_argument("--steps", type=int, default=64, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row count")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM's async scheduling on")
    parser.add_argument("--model-dir", help="default: host_overhead.py's thin model (built once)")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="bfloat16: the native dense kernels' layers, stacked (models.layer_stacks)",
    )
    parser.add_argument("--out", help="JSON path (default benchmarks/out/host_cpu_time.json)")
    return parser.parse_args(argv)


class _WorkerClock:
    """Adds the engine thread's CPU time inside the worker's step calls (and profiles them)."""

    def __init__(self, profiler: cProfile.Profile | None):
        self.seconds = 0.0
        self.calls = 0
        self.profiler = profiler

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(worker, *args, **kwargs):
            start = time.thread_time()
            if self.profiler is not None:
                self.profiler.enable()
            try:
                return original(worker, *args, **kwargs)
            finally:
                if self.profiler is not None:
                    self.profiler.disable()
                self.seconds += time.thread_time() - start
                self.calls += 1

        setattr(owner, name, timed)


def _phase_clocks() -> dict[str, _WorkerClock]:
    """A clock inside each of `PHASES` the tree has (its functions wrapped where they are called)."""
    import importlib

    clocks = {}
    for label, module_name, path in PHASES:
        owner = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is None or not hasattr(owner, name):
            continue
        clock = _WorkerClock(None)
        function = getattr(owner, name)
        if isinstance(owner, type):
            clock.wrap(owner, name)
        else:  # a module function: wrap it as a plain function (no bound `self`)

            def timed(*args, _f=function, _c=clock, **kwargs):
                start = time.thread_time()
                try:
                    return _f(*args, **kwargs)
                finally:
                    _c.seconds += time.thread_time() - start
                    _c.calls += 1

            setattr(owner, name, timed)
        clocks[label] = clock
    return clocks


def _run(llm, prompts: list[list[int]], steps: int, clock: _WorkerClock) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    before_s, before_steps = clock.seconds, _runner_steps(llm)
    wall = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - wall
    engine_steps = _runner_steps(llm) - before_steps
    return {"cpu_ms_per_step": 1e3 * (clock.seconds - before_s) / engine_steps,
            "steps": engine_steps, "wall_ms_per_step": 1e3 * wall / engine_steps}  # fmt: skip


def _runner_steps(llm) -> int:
    return llm.collective_rpc("runner_stats")[0]["steps"]


def measure(model_dir: str, rows: int, args: argparse.Namespace) -> dict:
    """Decode steps of `rows` requests: CPU ms a step of the worker's calls (prefill and
    warm-up subtracted by running the same prompts twice: once to `--steps` tokens, once to 1)."""
    import numpy as np
    from vllm import LLM

    from plugin_shim import worker
    from plugin_shim.worker import XlaWorker

    # CPU time, not wall time: waiting for the device would otherwise dominate.
    profiler = cProfile.Profile(time.thread_time) if args.profile else None
    clock = _WorkerClock(None)
    for name in ("execute_model", "sample_tokens"):
        clock.wrap(XlaWorker, name)
    if args.async_scheduling:  # the step's output is made when vLLM asks for it
        clock.wrap(worker._AsyncOutput, "get_output")
    phases = _phase_clocks()
    llm = LLM(
        model=model_dir, dtype=args.dtype, seed=0, async_scheduling=args.async_scheduling, max_model_len=1024,
        max_num_seqs=rows, max_num_batched_tokens=max(1024, rows * PROMPT_LEN),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, 8000, size=(rows, PROMPT_LEN)).tolist()
    _run(llm, prompts[:2], 4, clock)  # warm-up
    runs = []
    for _ in range(args.repeats):
        marks = {label: c.seconds for label, c in phases.items()}
        full = _run(llm, prompts, args.steps, clock)
        after_full = {label: c.seconds for label, c in phases.items()}
        prefill = _run(llm, prompts, 1, clock)  # the prefill step alone
        decode_steps = full["steps"] - prefill["steps"]
        cpu = full["cpu_ms_per_step"] * full["steps"] - prefill["cpu_ms_per_step"] * prefill["steps"]
        # Phases: the full run less the prefill-only run (same prompts, same first step).
        phase_ms = {
            label: 1e3 * ((after_full[label] - marks[label]) - (c.seconds - after_full[label])) / decode_steps
            for label, c in phases.items()
        }
        runs.append({"decode_cpu_ms_per_step": cpu / decode_steps, "decode_steps": decode_steps,
                     "wall_ms_per_step": full["wall_ms_per_step"], "phases_ms": phase_ms})  # fmt: skip
    profile_text = None
    if profiler is not None:
        clock.profiler = profiler
        _run(llm, prompts, args.steps, clock)
        clock.profiler = None
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
        profile_text = out.getvalue()
    del llm
    median = statistics.median(r["decode_cpu_ms_per_step"] for r in runs)
    phase_ms = {label: statistics.median(r["phases_ms"][label] for r in runs) for label in phases}
    return {"rows": rows, "runs": runs, "decode_cpu_ms_per_step": median, "phases_ms": phase_ms,
            "profile": profile_text}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("VLLM_XLA_PLATFORM", "cpu")
    os.environ.setdefault("VLLM_XLA_CPU_KV_CACHE_GB", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.async_scheduling:
        os.environ["VLLM_XLA_CPU_ASYNC_SCHEDULING"] = "1"
    model_dir = args.model_dir
    if model_dir is None:
        sys.path.insert(0, str(HERE))
        import _peers
        import host_overhead

        model_dir = host_overhead.thin_model_dir(_peers.gguf_model_dir())
    load_before = os.getloadavg()
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        result = measure(model_dir, rows, args)
        results.append(result)
        each = " ".join(f"{r['decode_cpu_ms_per_step']:.3f}" for r in result["runs"])
        median = result["decode_cpu_ms_per_step"]
        print(f"{rows:4d} rows: host CPU ms per decode step {each}; median {median:.3f}")
        print("      " + ", ".join(f"{k} {v:.3f}" for k, v in result["phases_ms"].items()))
        if result["profile"]:
            print(result["profile"])
    out = pathlib.Path(args.out or HERE / "out" / "host_cpu_time.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        report = {
            "steps": args.steps,
            "async_scheduling": args.async_scheduling,
            "dtype": args.dtype,
            "nproc": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_before_after": [load_before, os.getloadavg()],
            "results": results,
        }
        out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
