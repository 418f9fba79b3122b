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
parallelism; refused at start, `docs/architecture.md`): the planner compiles the served program
with the experts over those chips and gives that form's chip by arithmetic
(`tpu_platform.planner.replicas`).

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
import dataclasses
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
    from tpu_platform.planner.plan import StepSetup, model_config

    # Experts over `--dp` replicas: the program compiled is the served one with its experts split
    # over all their chips (attention tensor-parallel over them too); `_with_replicas` then moves
    # attention back to each replica's chips by arithmetic.
    compiled_tp = tp_size * args.dp if args.ep else tp_size
    setup = StepSetup(
        model_config(model), target, dtype=args.dtype, kv_dtype=args.kv_dtype, max_num_seqs=args.batch,
        max_model_len=args.context, max_num_batched_tokens=args.prefill, tp_size=compiled_tp,
        quantization=quantization, expert_parallel=args.ep, speculative_tokens=_drafts(args),
    )  # fmt: skip
    row = _depth_row(setup, args, model) if args.depth else _whole_row(setup, args, model)
    return _with_replicas(_with_draft(row, setup, args), setup, args, tp_size)


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


def _with_replicas(row: dict, setup, args: argparse.Namespace, tp_size: int) -> dict:
    """`row` as `--dp` replicas of `tp_size` chips (`tpu_platform.planner.replicas`): a chip's
    weights and a replica's KV tokens, the steps keeping what the compiled program's keep beside
    its weights and cache. Without `--ep` the compiled program is the replica's own; with it the
    experts are split over every replica's chips (not served: refused at start)."""
    row["dp_size"] = args.dp
    if args.dp == 1 or not row["fits"]:
        return row
    from tpu_platform.planner.replicas import plan_replicas

    replica = dataclasses.replace(setup, tp_size=tp_size)
    steps = row["budget_bytes"] - row["weight_bytes"] - row["kv_bytes"]
    plan = plan_replicas(
        replica, args.dp, steps, experts_over_replicas=args.ep, memory_utilization=args.memory_utilization
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


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _weights(row: dict) -> str:
    """The weights' format: the model's dtype, or the quantization planned (int8, int8-g32, fp8,
    fp8-g128; reports older than quantization: none); a checkpoint's mxfp4 experts (GPT-OSS as
    released) beside them."""
    quantization = row.get("quantization", "none")
    weights = row["dtype"] if quantization == "none" else quantization
    return f"{weights}, mxfp4 experts" if row.get("mxfp4_experts") else weights


def _report(row: dict) -> str:
    tp = row.get("tp_size", 1)
    experts = ", experts by index" if row.get("expert_parallel") else ""
    split = f", split over {tp} chips{experts}, figures per chip" if tp > 1 else ""
    activations = f" x {row['dtype']} activations" if row.get("quantization", "none") != "none" else ""
    head = (
        f"{row['model']} on {row['target']} ({_weights(row)} weights{activations}, KV {row['kv_dtype']}, "
        f"{row['backend']}{split})"
    )
    if "state_bytes_per_request" in row:  # a hybrid: a state a request beside KV pages
        head += (
            f"; a request's states {row['state_bytes_per_request'] / 2**20:.2f} MiB beside "
            f"{row['kv_bytes_per_token']} B of KV a token, pages of {row['tokens_per_page']} tokens"
        )
    if not row["fits"]:
        return f"{head}: DOES NOT FIT: {row['reason']}"
    body = _depth_report(head, row) if row.get("depths") else _whole_report(head, row)
    return body + _draft_report(row) + _replicas_report(row)


def _replicas_report(row: dict) -> str:
    replicas = row.get("replicas")
    if replicas is None:
        return ""
    if replicas["experts_over_replicas"]:
        form = "experts split over all their chips, attention per replica (arithmetic: not served)"
    else:
        form = "each the program above, nothing exchanged between them"
    return (
        f"\n  as {replicas['dp_size']} replicas of {replicas['tp_size']} chip(s), {form}: per chip "
        f"weights {_gib(replicas['weight_bytes'])} GiB, KV {_gib(replicas['kv_bytes'])} GiB; "
        f"{replicas['kv_tokens']} tokens a replica, {replicas['total_kv_tokens']} in all; batch "
        f"{row['batch']} x {row['context']} a replica {'fits' if replicas['batch_fits'] else 'does NOT fit'}"
    )


def _draft_report(row: dict) -> str:
    draft = row.get("draft")
    if draft is None:
        return ""
    if "error" in draft:
        return f"\n  with {draft['model']}: not planned ({draft['error']})"
    return (
        f"\n  with {draft['model']} beside it: draft weights {_gib(draft['weight_bytes'])} GiB, "
        f"{draft['page_bytes']} B a page beside the target's {row['page_bytes']}; KV "
        f"{draft['kv_tokens']} tokens (alone {row['kv_tokens']})"
    )


def _whole_report(head: str, row: dict) -> str:
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


def _depth_report(head: str, row: dict) -> str:
    """`_report` of a row planned from its first layers (`--depth`)."""
    peak, roof, beyond = max(row["predicted_peak_bytes"].values()), row["roofline"], row["overhead_bytes"]
    return "\n".join([
        f"{head}, from its first {' and '.join(map(str, row['depths']))} layers",
        f"  per chip GiB: weights {_gib(row['weight_bytes'])}, KV {_gib(row['kv_bytes'])} "
        f"({row['kv_tokens']} tokens), beyond them decode {_gib(beyond['decode'])} / prefill "
        f"{_gib(beyond['prefill'])}, peak {_gib(peak)} of {_gib(row['hbm_bytes'])}; "
        f"batch {row['batch']} x {row['context']} tokens {'fits' if row['batch_fits'] else 'does NOT fit'}",
        f"  decode step roofline (not a measurement): {roof['seconds'] * 1e3:.2f} ms "
        f"({roof['tokens_per_second']:.0f} tok/s)",
    ])  # fmt: skip


def _model_cell(row: dict) -> str:
    """The model's name; planned from its first layers (`--depth`), which (none were compiled
    for a model whose weights alone exceed the chips)."""
    depths = row.get("depths") if row.get("short") else None
    return row["model"] if not depths else f"{row['model']} (from {'+'.join(map(str, depths))} layers)"


def _step_memory(row: dict) -> str:
    """The steps' memory beside the weights and cache, decode / prefill: the compiled programs'
    temporaries, or for a row planned from its first layers all they need beyond weights and
    cache, extrapolated."""
    if row.get("depths"):
        beyond = row["overhead_bytes"]
        return f"{_gib(beyond['decode'])} / {_gib(beyond['prefill'])}"
    return f"{_gib(row['decode']['temp_bytes'])} / {_gib(row['prefill']['temp_bytes'])}"


def _estimates(row: dict) -> tuple[str, str]:
    """XLA's cost model's and the HLO bytes' decode times, ms; none for a row planned from its
    first layers (a short program's are not the model's)."""
    if row.get("depths"):
        return "-", "-"
    xla = row["xla"]
    xla_seconds = xla["optimal_seconds"] or xla["bytes_accessed_seconds"]
    return "n/a" if not xla_seconds else f"{xla_seconds * 1e3:.1f}", f"{row['hlo']['seconds'] * 1e3:.1f}"


def markdown(rows: list[dict]) -> str:
    """One table of a results JSON: what fits and the decode estimates beside the roofline."""
    out = [
        "| model | target | weights | weights GiB | KV GiB (tokens) | temp GiB decode / prefill | "
        "batch x context | decode roofline ms (tok/s) | XLA cost model ms | HLO bytes ms (upper bound) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {_model_cell(r)} | {r['target']} | {_weights(r)} | {_gib(r['weight_bytes'])} |"
        if not r["fits"]:
            out.append(f"{head} does not fit: {_why_not(r)} | | | | | |")
            continue
        roof, (xla, hlo) = r["roofline"], _estimates(r)
        out.append(
            f"{head} {_gib(r['kv_bytes'])} ({r['kv_tokens']}) | {_step_memory(r)} | "
            f"{r['batch']} x {r['context']}: {'fits' if r['batch_fits'] else 'no'} | "
            f"{roof['seconds'] * 1e3:.1f} ({roof['tokens_per_second']:.0f}) | {xla} | {hlo} |"
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
        if r.get("replicas"):
            out.append(_replicas_markdown_row(r))
            continue
        chip = f"{_weights(r)} | {_gib(r['weight_bytes'])}"
        split = f"{r['tp_size']}, EP" if r.get("expert_parallel") else r["tp_size"]
        head = f"| {_model_cell(r)} | {r['target']} | {split} | {chip} |"
        if not r["fits"]:
            out.append(f"{head} does not fit: {_why_not(r)} | | | | | |")
            continue
        roof, (xla, _), exchanged = r["roofline"], _estimates(r), r["decode_collectives"]
        out.append(
            f"{head} {_gib(r['kv_bytes'])} ({r['kv_tokens']}) | {_step_memory(r)} | {r['batch']} x "
            f"{r['context']}: {'fits' if r['batch_fits'] else 'no'} | "
            f"{roof['seconds'] * 1e3:.1f} ({roof['tokens_per_second']:.0f}) | {xla} | "
            f"{exchanged['count']} ({exchanged['bytes'] / (1 << 20):.1f}) |"
        )
    return "\n".join(out)


def _replicas_markdown_row(r: dict) -> str:
    """A `--dp` row: a replica's chip and cache, the tokens of all replicas, and the decode
    throughput of all of them; with the experts over every replica's chips (not served), only
    the arithmetic: the program compiled was the one with attention split over them all."""
    rep = r["replicas"]
    over = rep["experts_over_replicas"]
    split = f"DP {rep['dp_size']} x TP {rep['tp_size']}" + (f", EP {rep['chips']}" if over else "")
    head = f"| {_model_cell(r)} | {r['target']} | {split} | {_weights(r)} | {_gib(rep['weight_bytes'])} |"
    cache = f"{_gib(rep['kv_bytes'])} ({rep['kv_tokens']} a replica, {rep['total_kv_tokens']} in all)"
    fits = f"{r['batch']} x {r['context']} a replica: {'fits' if rep['batch_fits'] else 'no'}"
    if over:
        return f"{head} {cache} | {_step_memory(r)} | {fits} | - | - | not compiled: not served |"
    roof, (xla, _), exchanged = r["roofline"], _estimates(r), r["decode_collectives"]
    total = rep["dp_size"] * roof["tokens_per_second"]
    return (
        f"{head} {cache} | {_step_memory(r)} | {fits} | {roof['seconds'] * 1e3:.1f} ({total:.0f} "
        f"all replicas) | {xla} | {exchanged['count']} ({exchanged['bytes'] / (1 << 20):.1f}) |"
    )


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
    split = any(r.get("tp_size", 1) > 1 or r.get("dp_size", 1) > 1 for r in rows)
    label = f"**{note[0].upper()}{note[1:]}.**\n\n"
    if rows and all("draft" in r for r in rows):  # planned with --draft: what the draft changes
        return label + draft_markdown([r for r in rows if "weight_bytes" in r["draft"]])
    return label + (tensor_parallel_markdown if split else markdown)(rows)


def draft_markdown(rows: list[dict]) -> str:
    """The rows planned with `--draft`: what the draft takes a chip and the KV it leaves."""
    out = [
        "| model | target | weights | draft | draft weights GiB | draft KV bytes a page (target's) | "
        "KV tokens alone | KV tokens with the draft |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["draft"]
        out.append(
            f"| {_model_cell(r)} | {r['target']} | {_weights(r)} | {d['model']} | "
            f"{_gib(d['weight_bytes'])} | "
            f"{d['page_bytes']} ({r['page_bytes']}) | {r['kv_tokens']} | {d['kv_tokens']} |"
        )
    return "\n".join(out)


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
        print(_report(row) + "\n")
    if args.json:
        path = pathlib.Path(args.json)
        if args.update and path.exists():
            rows = updated(json.loads(path.read_text())["results"], rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"note": NOTE, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
