# SPDX-License-Identifier: Apache-2.0
"""Deployment planner: what a model needs on each chip of a TPU or GPU target, from the compiled
step programs. COMPILER ESTIMATES AND ROOFLINES, NOT MEASUREMENTS: nothing here runs on a device.

For each model and target it compiles the runner's decode step (`--batch` sequences, one token
each), its prefill step (one `--prefill`-token chunk) and its sampler with the target's real
compiler (`tpu_platform.planner.plan`, weights abstract), sizes the KV cache to what is left of the
chip's memory (`tpu_platform.planner.kv.fit_kv_cache`) and prints per-chip weight, KV and
temporary bytes, the largest KV cache (tokens) that fits, and three decode-step times with the
tokens/s they imply:
  - roofline: weights + the batch's KV (`--context` tokens each) read once at peak bandwidth;
  - XLA: the cost model's `optimal_seconds` where usable (XLA's TPU model gives a negative
    figure for programs with Mosaic calls, and a GPU compiled without a device gives none), else
    its `bytes accessed` at peak bandwidth;
  - HLO: the bytes the optimized program's instructions move (`tpu_platform.planner.hlo`) at peak
    bandwidth, with the operation kinds that move most. An upper bound: an in-place cache write
    (scatter) and an attention kernel are charged the whole cache they take as an operand.

    python benchmarks/plan.py --model llama-3.1-8b --target v5e-1 v6e-1 h100x1 \
        --quantization none int8 --json OUT
    python benchmarks/plan.py --model llama-3.1-70b --target v6e-8 h100x8 --tp 1 4 8 \
        --quantization none int8 --json OUT
    python benchmarks/plan.py --markdown benchmarks/results/plan.json

`--quantization none int8` plans each model, target and TP size with the weights as the runner
serves them (`none`: in `--dtype`) and as `--quantization int8_per_channel_weight_only` serves
them (`int8`: every dense kernel int8 with a float32 scale per output channel, activations in
`--dtype`; the embedding table stays in `--dtype`); the roofline then reads the int8 bytes.

`--tp N [N ...]` splits the model over N chips of the target as the runner's tensor parallelism
does (the rules table of `models.sharding`, the KV cache split on its heads): every figure is then
per chip, and a row also counts the collectives (and the bytes they give) of the decode step.
`--ep` plans a mixture of experts under `--enable-expert-parallel`: at each TP size > 1 the
experts split by index over the chips (whole experts a chip), the rest tensor-parallel.
A model too large for its chips is reported as not fitting, by how much.

`--model` takes a known name (`tpu_platform/planner/model_configs/`), an HF `config.json` or a model
directory. The toolchains come from `make aot-toolchains` (`.aot/`, or `VLLM_XLA_AOT_DIR`): the
planner runs each platform's compiles in a subprocess that has that toolchain on its path.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tpu_platform.planner.plan import QUANTIZATIONS  # noqa: E402
from tpu_platform.planner.targets import TARGETS  # noqa: E402

GIB = 1 << 30
NOTE = "compiler estimates and rooflines from compile-only targets, not measurements"
_TOOLCHAIN_MARKERS = {"tpu": "libtpu", "cuda": "jax_plugins"}


def plan_one(model: str, target: str, tp_size: int, quantization: str, args: argparse.Namespace) -> dict:
    """Compiles and sizes `model` split over `tp_size` chips of `target` with its weights
    quantized so (in a process with its toolchain); every byte and time is per chip."""
    from tpu_platform.planner.kv import decode_roofline, fit_kv_cache, xla_decode_estimate
    from tpu_platform.planner.plan import StepSetup, model_config

    setup = StepSetup(
        model_config(model), target, dtype=args.dtype, kv_dtype=args.kv_dtype, max_num_seqs=args.batch,
        max_model_len=args.context, max_num_batched_tokens=args.prefill, tp_size=tp_size,
        quantization=quantization, expert_parallel=args.ep,
    )  # fmt: skip
    fit = fit_kv_cache(setup, args.batch, args.prefill, args.memory_utilization)
    bandwidth = setup.compile_target.hbm_bytes_per_second
    row = {
        "model": model, "target": target, "tp_size": tp_size, "expert_parallel": args.ep, "dtype": args.dtype,
        "quantization": quantization, "kv_dtype": setup.cache_dtype, "batch": args.batch,
        "context": args.context, "prefill": args.prefill,
        "backend": setup.backend, "hbm_bytes": setup.compile_target.hbm_bytes,
        "hbm_bytes_per_second": bandwidth, "roofline": decode_roofline(setup, args.batch, args.context),
        **fit.as_dict(),
    }  # fmt: skip
    if fit.decode is not None:
        row["batch_fits"] = fit.kv_tokens >= args.batch * args.context
        row["xla"] = xla_decode_estimate(setup, fit.decode, args.batch)
        seconds = fit.decode.traffic.total_bytes / bandwidth
        row["hlo"] = {"seconds": seconds, "tokens_per_second": args.batch / seconds}
        exchanged = fit.decode.collectives
        row["decode_collectives"] = {"count": len(exchanged), "bytes": sum(c.result_bytes for c in exchanged)}
    return row


def _worker(args: argparse.Namespace) -> None:
    rows = [
        plan_one(model, target, tp, quantization, args)
        for model in args.model
        for target in args.target
        for tp in args.tp
        for quantization in args.quantization
    ]
    print(json.dumps(rows))


def _in_toolchain(platform: str, targets: list[str], argv: list[str]) -> list[dict]:
    """Runs this script's worker for `targets` in a process with `platform`'s compiler."""
    aot = pathlib.Path(os.environ.get("VLLM_XLA_AOT_DIR", REPO / ".aot")) / platform
    if not (aot / _TOOLCHAIN_MARKERS[platform]).is_dir():
        raise SystemExit(f"no {platform} compile toolchain in {aot}: run `make aot-toolchains`")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(aot), str(REPO)]), "JAX_PLATFORMS": "cpu"}
    env.update(TPU_ACCELERATOR_TYPE="v5litepod-4", TPU_WORKER_HOSTNAMES="localhost", TF_CPP_MIN_LOG_LEVEL="2")
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock
    command = [sys.executable, __file__, "--worker", *argv, "--target", *targets]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {platform} planner failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _weights(row: dict) -> str:
    """The weights' format: the model's dtype, or the quantization planned (int8, int8-g32, fp8,
    fp8-g128; reports older than quantization: none)."""
    quantization = row.get("quantization", "none")
    return row["dtype"] if quantization == "none" else quantization


def _report(row: dict) -> str:
    tp = row.get("tp_size", 1)
    experts = ", experts by index" if row.get("expert_parallel") else ""
    split = f", split over {tp} chips{experts}, figures per chip" if tp > 1 else ""
    activations = f" x {row['dtype']} activations" if _weights(row) != row["dtype"] else ""
    head = (
        f"{row['model']} on {row['target']} ({_weights(row)} weights{activations}, KV {row['kv_dtype']}, "
        f"{row['backend']}{split})"
    )
    if not row["fits"]:
        return f"{head}: DOES NOT FIT: {row['reason']}"
    decode, prefill, roof = row["decode"], row["prefill"], row["roofline"]
    xla, hlo = row["xla"], row["hlo"]
    xla_seconds = xla["optimal_seconds"] or xla["bytes_accessed_seconds"]
    xla_label = "optimal_seconds" if xla["optimal_seconds"] else "bytes accessed / bandwidth"
    xla_text = "unavailable"
    if xla_seconds:
        xla_text = f"{xla_seconds * 1e3:.2f} ms ({row['batch'] / xla_seconds:.0f} tok/s)"
    kinds = ", ".join(f"{k['kind']} {_gib(k['bytes'])}" for k in decode["traffic"]["by_kind"][:3])
    lines = [
        f"{head}",
        f"  per chip GiB: weights {_gib(row['weight_bytes'])}, KV {_gib(row['kv_bytes'])} "
        f"({row['kv_tokens']} tokens), temp decode {_gib(decode['temp_bytes'])} / prefill "
        f"{_gib(prefill['temp_bytes'])}, peak {_gib(max(decode['peak_bytes'], prefill['peak_bytes']))} "
        f"of {_gib(row['hbm_bytes'])}; batch {row['batch']} x {row['context']} tokens "
        f"{'fits' if row['batch_fits'] else 'does NOT fit'}",
        f"  decode step (compiler estimates and rooflines, not measurements): roofline "
        f"{roof['seconds'] * 1e3:.2f} ms ({roof['tokens_per_second']:.0f} tok/s)",
        f"    XLA cost model ({xla_label}): {xla_text}",
        f"    HLO instruction bytes (upper bound): {hlo['seconds'] * 1e3:.2f} ms "
        f"({hlo['tokens_per_second']:.0f} tok/s); most from {kinds} GiB",
        f"  compiles: {row['compiles']}, decode {decode['compile_seconds']:.0f} s, prefill "
        f"{prefill['compile_seconds']:.0f} s, sampler {row['sampler']['compile_seconds']:.0f} s",
    ]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """One table of a results JSON: what fits and the decode estimates beside the roofline."""
    out = [
        "| model | target | weights | weights GiB | KV GiB (tokens) | temp GiB decode / prefill | "
        "batch x context | decode roofline ms (tok/s) | XLA cost model ms | HLO bytes ms (upper bound) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['target']} | {_weights(r)} | {_gib(r['weight_bytes'])} |"
        if not r["fits"]:
            out.append(f"{head} does not fit: {_why_not(r)} | | | | | |")
            continue
        roof, xla = r["roofline"], r["xla"]
        xla_seconds = xla["optimal_seconds"] or xla["bytes_accessed_seconds"]
        out.append(
            f"{head} {_gib(r['kv_bytes'])} "
            f"({r['kv_tokens']}) | {_gib(r['decode']['temp_bytes'])} / {_gib(r['prefill']['temp_bytes'])} | "
            f"{r['batch']} x {r['context']}: {'fits' if r['batch_fits'] else 'no'} | "
            f"{roof['seconds'] * 1e3:.1f} ({roof['tokens_per_second']:.0f}) | "
            f"{'n/a' if not xla_seconds else f'{xla_seconds * 1e3:.1f}'} | {r['hlo']['seconds'] * 1e3:.1f} |"
        )
    return "\n".join(out)


def tensor_parallel_markdown(rows: list[dict]) -> str:
    """One table of a results JSON planned at several TP sizes: per chip, what fits and the
    decode estimates, and what the decode step exchanges between the chips."""
    out = [
        "| model | target | TP | weights | weights GiB per chip | KV GiB per chip (tokens) | "
        "temp GiB decode / prefill | batch x context | decode roofline ms (tok/s) | XLA cost model ms | "
        "decode collectives (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chip = f"{_weights(r)} | {_gib(r['weight_bytes'])}"
        head = f"| {r['model']} | {r['target']} | {r['tp_size']} | {chip} |"
        if not r["fits"]:
            out.append(f"{head} does not fit: {_why_not(r)} | | | | | |")
            continue
        roof, xla, exchanged = r["roofline"], r["xla"], r["decode_collectives"]
        xla_seconds = xla["optimal_seconds"] or xla["bytes_accessed_seconds"]
        out.append(
            f"{head} {_gib(r['kv_bytes'])} ({r['kv_tokens']}) | {_gib(r['decode']['temp_bytes'])} / "
            f"{_gib(r['prefill']['temp_bytes'])} | {r['batch']} x {r['context']}: "
            f"{'fits' if r['batch_fits'] else 'no'} | "
            f"{roof['seconds'] * 1e3:.1f} ({roof['tokens_per_second']:.0f}) | "
            f"{'n/a' if not xla_seconds else f'{xla_seconds * 1e3:.1f}'} | "
            f"{exchanged['count']} ({exchanged['bytes'] / (1 << 20):.1f}) |"
        )
    return "\n".join(out)


def _why_not(row: dict) -> str:
    """Why a row does not fit: its weights' excess over the budget, or the planner's reason."""
    over = row["weight_bytes"] - row["budget_bytes"]
    if over <= 0:
        return row["reason"]
    return f"weights {_gib(over)} GiB over the {_gib(row['budget_bytes'])} GiB budget"


def render_markdown(report: dict) -> str:
    """A results JSON (`{"note", "results"}`) as its label and one table: what the docs show
    (with a TP column and per-chip figures when it was planned at several TP sizes)."""
    note = report.get("note") or NOTE
    rows = report["results"]
    split = any(r.get("tp_size", 1) > 1 for r in rows)
    return f"**{note[0].upper()}{note[1:]}.**\n\n" + (tensor_parallel_markdown if split else markdown)(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["llama-3.1-8b"])
    parser.add_argument("--target", nargs="+", default=["v5e-1", "v6e-1", "h100x1"], choices=sorted(TARGETS))
    parser.add_argument(
        "--tp", nargs="+", type=int, default=[1], help="tensor-parallel sizes (chips of the target)"
    )
    parser.add_argument(
        "--ep", action="store_true", help="split the experts by index (--enable-expert-parallel)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--quantization", nargs="+", default=["none"], choices=QUANTIZATIONS,
        help="weights to plan with: none (--dtype) and/or int8 (int8_per_channel_weight_only)",
    )  # fmt: skip
    parser.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    parser.add_argument("--batch", type=int, default=64, help="decode sequences (max_num_seqs)")
    parser.add_argument("--context", type=int, default=2048, help="tokens per sequence (max_model_len)")
    parser.add_argument("--prefill", type=int, default=2048, help="prefill chunk tokens")
    parser.add_argument("--memory-utilization", type=float, default=0.9)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", metavar="RESULTS", help="print a results JSON as one markdown table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.markdown:
        print(render_markdown(json.loads(pathlib.Path(args.markdown).read_text())))
        return
    if args.worker:
        _worker(args)
        return
    argv = [a for a in sys.argv[1:] if a not in args.target and a != "--target"]
    by_platform = {p: [t for t in args.target if TARGETS[t].platform == p] for p in ("tpu", "cuda")}
    with ThreadPoolExecutor(2) as pool:  # each platform's compiles in its own process, both at once
        answers = pool.map(
            lambda p: _in_toolchain(p, by_platform[p], argv), [p for p in by_platform if by_platform[p]]
        )
        rows = [row for answer in answers for row in answer]
    print("COMPILER ESTIMATES AND ROOFLINES, NOT MEASUREMENTS (per chip of each target)\n")
    for row in rows:
        print(_report(row) + "\n")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps({"note": NOTE, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
