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

`--dp D` plans D data-parallel replicas of `--tp` chips each (`--data-parallel-size`): each replica
compiles the program of its `--tp` chips, so the row is that program's, with a replica's KV
tokens, those of all D, and D times its throughput. With `--ep` too the experts are split over all
D x TP chips and attention stays on each replica's (vLLM's expert-parallel group under data
parallelism, `docs/architecture.md`): the planner compiles the replicas' own program
(`tpu_platform.replica_step`: each replica's chips attend to its requests, tensor-parallel over
them, the experts split by index over all D x TP chips).

`--depth` plans each row from the model's first 2 and 4 layers at full width
(`tpu_platform.planner.depth`: weights and KV per layer are arithmetic, what the steps need beyond
them is read from the two short compiles and extrapolated to every layer), for models whose
whole-model compiles take too long or too much memory; such a row names its depths, its step
memory is the extrapolated bytes beyond weights and cache, its decode collectives are
extrapolated alike, and it has no cost-model or HLO-bytes estimate (those of a short program are
not the model's). `--update` replaces the rows of the same model, target, TP size, quantization
and expert placement in the `--json` file (and appends new ones) instead of writing it anew.
`--speculative-tokens K` (4 by default with `--draft`) plans k drafts a request: a hybrid's
(Qwen3-Next's) requests then hold 1 + k blocks in each state group, out of its KV tokens.

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
sys.path.insert(0, str(REPO / "benchmarks"))
from _plan_report import NOTE, render_markdown, row_report  # noqa: E402

from tpu_platform.planner.plan import QUANTIZATIONS  # noqa: E402
from tpu_platform.planner.targets import TARGETS  # noqa: E402

_TOOLCHAIN_MARKERS = {"tpu": "libtpu", "cuda": "jax_plugins"}


def plan_one(model: str, target: str, tp_size: int, quantization: str, args: argparse.Namespace) -> dict:
    """Compiles and sizes `model` split over `tp_size` chips of `target` with its weights
    quantized so (in a process with its toolchain); every byte and time is per chip."""
    from tpu_platform.planner.plan import StepSetup, model_config

    # Experts over `--dp` replicas: the program compiled is the replicas' own
    # (`tpu_platform.replica_step`); without `--ep`, one replica's.
    replicas = args.dp if args.ep else 1
    setup = StepSetup(
        model_config(model), target, dtype=args.dtype, kv_dtype=args.kv_dtype, max_num_seqs=args.batch,
        max_model_len=args.context, max_num_batched_tokens=args.prefill, tp_size=tp_size,
        quantization=quantization, expert_parallel=args.ep, speculative_tokens=_drafts(args),
        dp_size=replicas,
    )  # fmt: skip
    row = _depth_row(setup, args, model) if args.depth else _whole_row(setup, args, model)
    return _with_replicas(_with_draft(row, setup, args), setup, args)


def _drafts(args: argparse.Namespace) -> int:
    """k drafts a request: `--speculative-tokens`, else 4 with `--draft` (a hybrid's requests
    then hold 1 + k state blocks: `tpu_platform.planner.hybrid.cache_tokens`), else none."""
    if args.speculative_tokens is not None:
        return args.speculative_tokens
    return 4 if args.draft else 0


def _whole_row(setup, args: argparse.Namespace, model: str) -> dict:
    """`plan_one` with every layer compiled."""
    from tpu_platform.planner.kv import fit_kv_cache, xla_decode_estimate

    fit = fit_kv_cache(setup, args.batch, args.prefill, args.memory_utilization)
    bandwidth = setup.compile_target.hbm_bytes_per_second
    row = {**_common(setup, args, model), **fit.as_dict()}
    if fit.decode is not None:
        row["batch_fits"] = fit.kv_tokens >= args.batch * args.context
        row["xla"] = xla_decode_estimate(setup, fit.decode, args.batch)
        seconds = fit.decode.traffic.total_bytes / bandwidth
        row["hlo"] = {"seconds": seconds, "tokens_per_second": args.batch / seconds}
        exchanged = fit.decode.collectives
        row["decode_collectives"] = {"count": len(exchanged), "bytes": sum(c.result_bytes for c in exchanged)}
    return row


def _with_replicas(row: dict, setup, args: argparse.Namespace) -> dict:
    """`row` as `--dp` replicas of `setup.tp_size` chips (`tpu_platform.planner.replicas`): a chip's
    weights and a replica's KV tokens, the steps keeping what the compiled program's keep beside
    its weights and cache. Without `--ep` the compiled program is the replica's own; with it the
    replicas' own, the experts split over every replica's chips."""
    row["dp_size"] = args.dp
    if args.dp == 1 or not row["fits"]:
        return row
    from tpu_platform.planner.replicas import plan_replicas

    steps = row["budget_bytes"] - row["weight_bytes"] - row["kv_bytes"]
    plan = plan_replicas(
        setup, args.dp, steps, experts_over_replicas=args.ep, memory_utilization=args.memory_utilization
    )
    row["replicas"] = {**plan.as_dict(), "batch_fits": plan.kv_tokens >= args.batch * args.context}
    return row


def _with_draft(row: dict, setup, args: argparse.Namespace) -> dict:
    """`row` with what `--draft` adds on its chip: the draft's weights and cache bytes a page, and
    the KV tokens left to the target once the draft is served beside it (the worker's split)."""
    if not args.draft or not row["fits"]:
        return row
    from tpu_platform.planner.draft import draft_memory, eagle3_head_like, eagle3_memory, pages_with_draft
    from tpu_platform.planner.hybrid import cache_tokens
    from tpu_platform.planner.plan import StepSetup, model_config

    try:
        if args.draft == "eagle3":
            memory = eagle3_memory(setup, eagle3_head_like(setup))
        else:
            draft = StepSetup(
                model_config(args.draft), setup.target, dtype=args.dtype, kv_dtype=args.kv_dtype,
                max_num_seqs=args.batch, max_model_len=args.context, max_num_batched_tokens=args.prefill,
                page_size=setup.tokens_per_page,  # one block size for both, the engine's
                tp_size=setup.tp_size,  # split on the target's mesh
            )  # fmt: skip
            if draft.config.vocab_size != setup.config.vocab_size:
                row["draft"] = {"model": args.draft, "error": "its vocabulary differs from the target's"}
                return row
            memory = draft_memory(draft)
    except ValueError as e:  # a drafter the target's mesh does not split
        row["draft"] = {"model": args.draft, "error": str(e)}
        return row
    pages = pages_with_draft(row["kv_bytes"], row["page_bytes"], memory)
    tokens = cache_tokens(setup.kv_layout, pages, setup.tokens_per_page, args.batch)
    row["draft"] = {
        "model": args.draft, "weight_bytes": memory.weight_bytes, "page_bytes": memory.page_bytes,
        "num_pages": pages, "kv_tokens": tokens,
    }  # fmt: skip
    return row


def _common(setup, args: argparse.Namespace, model: str) -> dict:
    """A row's setup: what was planned, on which chip, and the decode roofline."""
    from tpu_platform.planner.kv import decode_roofline

    return {
        "model": model, "target": setup.target, "tp_size": setup.tp_size, "expert_parallel": args.ep,
        "dtype": args.dtype, "quantization": setup.quantization, "kv_dtype": setup.cache_dtype,
        "batch": args.batch, "context": args.context, "prefill": args.prefill, "backend": setup.backend,
        "hbm_bytes": setup.compile_target.hbm_bytes,
        "hbm_bytes_per_second": setup.compile_target.hbm_bytes_per_second,
        "roofline": decode_roofline(setup, args.batch, args.context),
        "mxfp4_experts": bool(getattr(setup.config, "mxfp4", False)),
        **_state_bytes(setup),
    }  # fmt: skip


def _state_bytes(setup) -> dict:
    """A hybrid's KV bytes a token and state bytes a request, per chip (its page holds both)."""
    if not setup.config.state_layers:
        return {}
    from tpu_platform.kv_cache import kv_cache_dtype
    from tpu_platform.planner.hybrid import hybrid_page_bytes

    page = hybrid_page_bytes(
        setup.config, setup.tokens_per_page, setup.kv_heads_per_chip, kv_cache_dtype(setup.cache_dtype),
        setup.dtype, setup.backend, setup.tp_size,
    )  # fmt: skip
    return {
        "kv_bytes_per_token": page.kv_bytes_per_token,
        "state_bytes_per_request": page.state_bytes_per_request,
        "tokens_per_page": page.tokens_per_page,
    }


def _depth_row(setup, args: argparse.Namespace, model: str) -> dict:
    """`plan_one` from the model's first layers (`--depth`, `tpu_platform.planner.depth`)."""
    from tpu_platform.planner.depth import fit_by_depth

    fit = fit_by_depth(setup, args.batch, args.prefill, memory_utilization=args.memory_utilization)
    row = {**_common(setup, args, model), **fit.as_dict()}
    if fit.fits:
        row["batch_fits"] = fit.kv_tokens >= args.batch * args.context
        row["compiles"] = 1 + sum(len(programs) for programs in fit.short.values())
        (shallow, deep), layers = fit.depths, setup.config.num_layers
        counts = [len(p.collectives) for p in fit.short["decode"]]
        sizes = [sum(c.result_bytes for c in p.collectives) for p in fit.short["decode"]]
        # Each layer adds the same collectives: a straight line through the two depths.
        row["decode_collectives"] = {
            "count": round(counts[0] + (counts[1] - counts[0]) * (layers - shallow) / (deep - shallow)),
            "bytes": round(sizes[0] + (sizes[1] - sizes[0]) * (layers - shallow) / (deep - shallow)),
        }
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


def _key(row: dict) -> tuple:
    """What a row plans: model, target, TP size, weights, expert placement and draft."""
    return (
        row["model"], row["target"], row.get("tp_size", 1), row.get("quantization", "none"),
        bool(row.get("expert_parallel")), row.get("draft", {}).get("model"), row.get("dp_size", 1),
    )  # fmt: skip


def updated(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` rows with those `new` plans again replaced in place, the other new rows after them."""
    fresh = {_key(row): row for row in new}
    kept = [fresh.pop(_key(row), row) for row in old]
    return kept + [row for row in new if _key(row) in fresh]


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
    parser.add_argument(
        "--dp", type=int, default=1, help="data-parallel replicas of --tp chips each (--data-parallel-size)"
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
    parser.add_argument("--depth", action="store_true", help="plan from the first 2 and 4 layers")
    parser.add_argument(
        "--draft", metavar="MODEL", help="a draft model (known name or config) or 'eagle3' served beside"
    )
    parser.add_argument(
        "--speculative-tokens", type=int, help="k drafts a request (default: 4 with --draft, else 0)"
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--update", action="store_true", help="replace the same rows in --json, keep the others"
    )
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
        print(row_report(row) + "\n")
    if args.json:
        path = pathlib.Path(args.json)
        if args.update and path.exists():
            rows = updated(json.loads(path.read_text())["results"], rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"note": NOTE, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
