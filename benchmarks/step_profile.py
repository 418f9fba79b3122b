# SPDX-License-Identifier: Apache-2.0
"""Where a decode step of the embedded model spends its time on the CPU device, per row count:
the native dense kernels, attention, the other XLA ops, and our host path.

    .venv/bin/python benchmarks/step_profile.py [--rows 1,16,64] [--context 128] [--steps 16]
        [--dtype float32] [--weights as-shipped|int8|float] [--top-ops N]
        [--out benchmarks/out/step_profile.json]

The runner serves the embedded SmolLM2-135M directly (no vLLM engine: its scheduling is not ours
to profile): for each row count R, R requests of `--context` random prompt tokens are prefilled
one by one, then `--steps` greedy decode steps of all R rows run inside a JAX profiler trace
(Python tracing off). Every operation XLA:CPU runs is a trace event naming its HLO instruction;
the compiled programs' text says which custom call each is. Per decode step it reports the
wall time, then the busy time of each part summed over XLA's threads (so the parts can add up
to more than the wall time when both cores work): `dense` (the native dense kernels: the
projections and the LM head), `attention` (the native paged attention), `rope+kv write`,
`activation` (SiLU-and-multiply), `other XLA` (norms, residual adds, the embedding gather, the
argmax, copies), and `host` (the engine thread's CPU time in `Runner.execute` and `Runner.sample`,
`time.thread_time`). A greedy step runs no sampler program: the forward's argmax serves it.
`--weights` serves the model from its GGUF's own Q4_1 blocks (as it ships), as int8 weights
quantized at load, or from the dequantized float32 copy (`throughput.py`'s) in `--dtype`;
`--top-ops N` also prints the N busiest operations with their custom-call targets.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

# Custom-call targets by part (`pallas_kernels.cpu`); anything else XLA runs is "other XLA".
PARTS = (("dense", "dense"), ("attention", "attention"), ("rope+kv write", "rope"), ("activation", "silu"))
WEIGHTS = ("as-shipped", "int8", "float")
CUSTOM_CALL = re.compile(r"%?([\w.\-]+) = .*custom-call\(.*custom_call_target=\"([^\"]+)\"")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64", help="comma list of decode row counts")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=16, help="profiled decode steps per row count")
    parser.add_argument("--dtype", default="float32", help="the model's dtype")
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="as-shipped",
        help="as-shipped: the GGUF's own Q4_1 blocks; int8: quantized at load (int8 per channel); "
        "float: the dequantized float32 safetensors copy served in --dtype",
    )
    parser.add_argument("--top-ops", type=int, default=0, help="also print the N busiest operations")
    parser.add_argument("--out", help="JSON path (default benchmarks/out/step_profile.json)")
    return parser.parse_args(argv)


def _runner(model_dir: str, rows: int, context: int, dtype: str, quantization: str | None):
    from tpu_platform.envs import read_env
    from tpu_platform.runner import Runner, RunnerConfig

    config = RunnerConfig(
        model_path=model_dir, dtype=dtype, quantization=quantization, max_model_len=2 * context + 64,
        max_num_seqs=rows, max_num_batched_tokens=max(context, rows), page_size=128,
        cache_dir=read_env().cache_dir,
    )  # fmt: skip
    runner = Runner(config)
    runner.load_model()
    pages_each = -(-config.max_model_len // config.page_size)
    runner.initialize_kv_cache(rows * pages_each + 1)
    return runner, pages_each


def _update(new=(), cached=None, scheduled=None):
    from tpu_platform.step_update import CachedRequests, StepUpdate

    cached = cached or CachedRequests([], [], frozenset(), [], [])
    return StepUpdate(list(new), cached, frozenset(), scheduled or {})


def _serve(runner, rows: int, context: int, pages_each: int, steps: int, trace_dir: str | None):
    """Prefills `rows` requests, then runs `steps` decode steps of all of them (traced when
    `trace_dir`); returns (wall seconds per decode step, host CPU seconds per decode step)."""
    import jax
    import numpy as np

    from tpu_platform.sampling import SamplingOptions
    from tpu_platform.step_update import CachedRequests, NewRequest

    rng = np.random.default_rng(0)
    greedy = SamplingOptions(temperature=0.0)
    ids = [f"r{i}" for i in range(rows)]
    for i, req_id in enumerate(ids):
        prompt = rng.integers(100, 40000, size=context).tolist()
        pages = list(range(1 + i * pages_each, 1 + (i + 1) * pages_each))
        runner.execute(_update([NewRequest(req_id, prompt, [pages], 0, greedy)], scheduled={req_id: context}))
        runner.sample()
    computed = context

    def decode_step() -> float:
        nonlocal computed
        cached = CachedRequests(
            ids, [None] * rows, frozenset(), [computed] * rows, [computed - context] * rows
        )
        start = time.thread_time()
        runner.execute(_update(cached=cached, scheduled=dict.fromkeys(ids, 1)))
        step = runner.sample_async()
        host = time.thread_time() - start
        jax.block_until_ready(step.out.sampled_token_ids)
        start = time.thread_time()
        runner.finish(step)
        computed += 1
        return host + time.thread_time() - start

    for _ in range(3):  # the decode program's first runs
        decode_step()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    host, start = [], time.perf_counter()
    if trace_dir is None:
        host = [decode_step() for _ in range(steps)]
    else:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
            host = [decode_step() for _ in range(steps)]
    return (time.perf_counter() - start) / steps, statistics.median(host)


def _targets(runner) -> dict[str, str]:
    """HLO instruction name -> custom-call target, over every program the runner compiled."""
    names: dict[str, str] = {}
    for key in runner.programs.keys():
        compiled = runner.programs.get(key)
        for match in CUSTOM_CALL.finditer(compiled.as_text()):
            names[match.group(1)] = match.group(2)
    return names


def _part(op: str, targets: dict[str, str]) -> str:
    target = targets.get(op)
    if target is None:
        return "other XLA"
    return next((part for part, key in PARTS if key in target.lower()), "other XLA")


def _op_busy_ms(trace_dir: str, steps: int) -> dict[str, float]:
    """Busy milliseconds per decode step of each HLO operation, from the trace's events."""
    path = next(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    busy: dict[str, float] = collections.defaultdict(float)
    for event in events:
        op = event.get("args", {}).get("hlo_op")
        if event.get("ph") == "X" and op and not event["name"].startswith("end: "):
            busy[op] += event.get("dur", 0.0) / 1e3 / steps
    return dict(busy)


def _parts(ops: dict[str, float], targets: dict[str, str]) -> dict[str, float]:
    busy: dict[str, float] = collections.defaultdict(float)
    for op, ms in ops.items():
        busy[_part(op, targets)] += ms
    return dict(busy)


def _weights_source(weights: str, gguf_dir: str) -> tuple[str, str | None]:
    """(model directory, vLLM quantization) serving the embedded model with `weights`."""
    import _peers

    if weights == "float":
        return _peers.hf_model_dir(gguf_dir), None
    return gguf_dir, "int8_per_channel_weight_only" if weights == "int8" else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import _peers

    model_dir, quantization = _weights_source(args.weights, _peers.gguf_model_dir())
    load_before = os.getloadavg()
    report = []
    for rows in (int(r) for r in args.rows.split(",")):
        runner, pages_each = _runner(model_dir, rows, args.context, args.dtype, quantization)
        wall, _ = _serve(runner, rows, args.context, pages_each, args.steps, None)  # untraced
        with tempfile.TemporaryDirectory() as trace_dir:
            _, host = _serve(runner, rows, args.context, pages_each, args.steps, trace_dir)
            ops, targets = _op_busy_ms(trace_dir, args.steps), _targets(runner)
        busy = _parts(ops, targets)
        row = {"rows": rows, "wall_ms": 1e3 * wall, "host_cpu_ms": 1e3 * host, "busy_ms": busy}
        report.append(row)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1]))
        print(
            f"{rows:4d} rows: {1e3 * wall:.1f} ms a step (untraced); busy ms: {parts}; host {1e3 * host:.2f}"
        )
        for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[: args.top_ops]:
            print(f"    {ms:7.3f} ms  {op}  {targets.get(op, '')}")
        del runner
    out = pathlib.Path(args.out or HERE / "out" / "step_profile.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"weights": args.weights, "dtype": args.dtype, "context": args.context, "steps": args.steps,
            "nproc": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_before_after": [load_before, os.getloadavg()]}  # fmt: skip
    out.write_text(json.dumps({**info, "results": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
