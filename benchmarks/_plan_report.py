# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/plan.py`'s reports: a planned row as text (`row_report`) and the results JSON as
markdown tables (`render_markdown`: one chip, tensor parallel and drafts apart). COMPILER
ESTIMATES AND ROOFLINES, NOT MEASUREMENTS."""

from __future__ import annotations

GIB = 1 << 30
NOTE = "compiler estimates and rooflines from compile-only targets, not measurements"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _weights(row: dict) -> str:
    """The weights' format: the model's dtype, or the quantization planned (int8, int8-g32, fp8,
    fp8-g128; reports older than quantization: none); a checkpoint's mxfp4 experts (GPT-OSS as
    released) beside them."""
    quantization = row.get("quantization", "none")
    weights = row["dtype"] if quantization == "none" else quantization
    return f"{weights}, mxfp4 experts" if row.get("mxfp4_experts") else weights


def row_report(row: dict) -> str:
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
        form = "experts split over all their chips, attention per replica (the program above)"
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
    """`row_report` of a row planned from its first layers (`--depth`)."""
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


def _table_head(*columns: str) -> list[str]:
    """A markdown table's header row and its separator, one cell a column."""
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def markdown(rows: list[dict]) -> str:
    """One table of a results JSON: what fits and the decode estimates beside the roofline."""
    out = _table_head(
        "model", "target", "weights", "weights GiB", "KV GiB (tokens)", "temp GiB decode / prefill",
        "batch x context", "decode roofline ms (tok/s)", "XLA cost model ms", "HLO bytes ms (upper bound)",
    )  # fmt: skip
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
    out = _table_head(
        "model", "target", "TP", "weights", "weights GiB per chip", "KV GiB per chip (tokens)",
        "temp GiB decode / prefill", "batch x context", "decode roofline ms (tok/s)", "XLA cost model ms",
        "decode collectives (MiB)",
    )  # fmt: skip
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
    throughput of all of them (with the experts over the replicas: their own program's)."""
    rep = r["replicas"]
    over = rep["experts_over_replicas"]
    split = f"DP {rep['dp_size']} x TP {rep['tp_size']}" + (f", EP {rep['chips']}" if over else "")
    head = f"| {_model_cell(r)} | {r['target']} | {split} | {_weights(r)} | {_gib(rep['weight_bytes'])} |"
    cache = f"{_gib(rep['kv_bytes'])} ({rep['kv_tokens']} a replica, {rep['total_kv_tokens']} in all)"
    fits = f"{r['batch']} x {r['context']} a replica: {'fits' if rep['batch_fits'] else 'no'}"
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
    out = _table_head(
        "model", "target", "weights", "draft", "draft weights GiB", "draft KV bytes a page (target's)",
        "KV tokens alone", "KV tokens with the draft",
    )  # fmt: skip
    for r in rows:
        d = r["draft"]
        out.append(
            f"| {_model_cell(r)} | {r['target']} | {_weights(r)} | {d['model']} | "
            f"{_gib(d['weight_bytes'])} | "
            f"{d['page_bytes']} ({r['page_bytes']}) | {r['kv_tokens']} | {d['kv_tokens']} |"
        )
    return "\n".join(out)
