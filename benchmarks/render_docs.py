# SPDX-License-Identifier: Apache-2.0
"""Writes docs/performance.md and the README's performance table from the committed benchmark JSON.

    .venv/bin/python benchmarks/render_docs.py           # rewrite both from benchmarks/results/
    .venv/bin/python benchmarks/render_docs.py --check   # exit 1 when either differs from its render

Inputs, all in `benchmarks/results/` (the only benchmark output kept in git):
  throughput-<machine kind>.json   a `throughput.py` report, one file per machine kind (the name
                                   after `throughput-` is the kind's label, e.g. `amd-epyc-avx512bf16-2cpu`)
  plan.json                        optional: the planner's report (compiler estimates, not
                                   measurements), rendered by `benchmarks/plan.py` into both
  plan-tp.json                     optional: the planner's report at several tensor-parallel
                                   sizes (`plan.py --tp`), rendered alike into both
  plan-draft.json                  optional: the planner's rows with a draft served beside the
                                   target (`plan.py --draft`), rendered into docs/performance.md
A new measurement replaces its kind's file; the history of the figures is the history of that file
in git, never prose. `tests/docs/test_docs.py` fails when the committed README or docs/performance.md
differ from what this script renders from the committed JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import _report  # noqa: E402
from _attention_section import attention_kernel_section  # noqa: E402
from _device_section import device_sections  # noqa: E402
from _performance_text import (  # noqa: E402
    INTRO,
    PLANNER_DRAFT_INTRO,
    PLANNER_INTRO,
    PLANNER_PENDING,
    PLANNER_TP_INTRO,
    STEP_TIME_INTRO,
    WHAT_MOVES,
)

RESULTS = HERE / "results"
README = REPO / "README.md"
PERFORMANCE = REPO / "docs" / "performance.md"
PLAN_JSON = RESULTS / "plan.json"
STEP_PROFILE_JSON = RESULTS / "step_profile.json"
CPU_ATTENTION_JSON = RESULTS / "cpu_attention.json"
HOST_CPU_JSON = RESULTS / "host_cpu_time.json"
PLAN_TP_JSON = RESULTS / "plan-tp.json"
PLAN_DRAFT_JSON = RESULTS / "plan-draft.json"
PLAN_SCRIPT = HERE / "plan.py"
TABLE_BEGIN = "<!-- performance table: written by benchmarks/render_docs.py, do not edit -->"
TABLE_END = "<!-- end of performance table -->"
PLAN_BEGIN = "<!-- planner table: written by benchmarks/render_docs.py, do not edit -->"
PLAN_END = "<!-- end of planner table -->"
NO_PLAN = "No planner report is committed (`benchmarks/results/plan.json`, written by `benchmarks/plan.py`)."
PLAN_TP_BEGIN = "<!-- tensor-parallel planner table: written by benchmarks/render_docs.py, do not edit -->"
PLAN_TP_END = "<!-- end of tensor-parallel planner table -->"
NO_PLAN_TP = (
    "No tensor-parallel planner report is committed (`benchmarks/results/plan-tp.json`, written by "
    "`benchmarks/plan.py --tp`)."
)

# The README's headline rows (labels of `_report.METRICS`); a row no run measured is left out.
HEADLINE = (
    "batch output tok/s",
    "single tok/s",
    "single first token ms",
    "serve output tok/s",
    "serve TTFT p50 ms",
    "serve ITL p50 ms",
    "batch start-up s",
)
# Rows of our int8 and bfloat16 peers against the model as it ships, where a run has them
# (`--peers ...,xla-int8,xla-bf16`): both workloads on the performance page, the single stream
# (what a 4-bit file is for on a CPU) in the README.
OWN_HEADLINE = ("batch output tok/s", "single tok/s")
README_OWN_HEADLINE = ("single tok/s",)
OWN_PAIRS = (
    ("xla-int8", "xla", "ours int8 / ours as the model ships (embedded: Q4_1)"),
    ("xla", "xla-bf16", "ours as the model ships (Q4_1) / ours bfloat16 (its dequantized weights)"),
)
METRIC_BY_LABEL = {m.label: m for m in _report.METRICS}


def load_runs(results: pathlib.Path = RESULTS) -> dict[str, dict[str, Any]]:
    """{machine kind: throughput report}, sorted by kind."""
    return {
        path.stem.removeprefix("throughput-"): json.loads(path.read_text())
        for path in sorted(results.glob("throughput-*.json"))
    }


def _number(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _pair(report: dict[str, Any], label: str, peer: str) -> str:
    """`ours / theirs (ratio)` for one metric, or '-' when either side is missing."""
    metric = METRIC_BY_LABEL[label]
    ours = _report.value(report["results"], metric, "xla")
    theirs = _report.value(report["results"], metric, peer)
    ratio = _report.ratios(report["results"])[label][f"xla/{peer}"]
    if ratio is None:
        return "-"
    return f"{_number(ours)} / {_number(theirs)} (**{ratio:.2f}x**)"


def _own_pair(report: dict[str, Any], label: str, first: str, second: str) -> str:
    """`first / second (ratio)` of two of our peers for one metric, or '-' without both."""
    metric = METRIC_BY_LABEL[label]
    ratio = _report.ratios(report["results"])[label].get(f"{first}/{second}")
    if ratio is None:
        return "-"
    a, b = (_report.value(report["results"], metric, peer) for peer in (first, second))
    return f"{_number(a)} / {_number(b)} (**{ratio:.2f}x**)"


def _run_kind(report: dict[str, Any]) -> str:
    return "quick sizes" if report["config"].get("quick") else "full sizes"


def readme_table(runs: dict[str, dict[str, Any]], own_labels: tuple[str, ...] = OWN_HEADLINE) -> str:
    """One table: headline metrics in rows, ours / vLLM's CPU backend per machine kind in columns,
    then `own_labels` for our other peers against the model as it ships."""
    if not runs:
        return "No benchmark results are committed yet (`benchmarks/results/`)."
    kinds = list(runs)
    header = ["metric (ours / vLLM CPU backend, same run)", *(f"{k} ({_run_kind(runs[k])})" for k in kinds)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in HEADLINE:
        cells = [_pair(runs[k], label, "vllm-cpu") for k in kinds]
        if any(c != "-" for c in cells):
            better = "higher" if METRIC_BY_LABEL[label].higher_is_better else "lower"
            lines.append(f"| {label} ({better} is better) | " + " | ".join(cells) + " |")
    for first, second, name in OWN_PAIRS:
        for label in own_labels:
            cells = [_own_pair(runs[k], label, first, second) for k in kinds]
            if any(c != "-" for c in cells):
                lines.append(f"| {name}: {label} (higher is better) | " + " | ".join(cells) + " |")
    loads = [f"{_peak_load(runs[k], 'xla')} / {_peak_load(runs[k], 'vllm-cpu')}" for k in kinds]
    lines.append(
        "| highest 1-min load average while each ran (2 means both cores busy) | " + " | ".join(loads) + " |"
    )
    return "\n".join(lines)


def _peak_load(report: dict[str, Any], peer: str) -> str:
    """The highest 1-minute load average recorded around `peer`'s workers (other jobs included)."""
    peaks = [
        max(before_after[0][0], before_after[1][0])
        for peers in report["results"].values()
        if (before_after := peers.get(peer, {}).get("load_average_before_after"))
    ]
    return f"{max(peaks):.1f}" if peaks else "-"


def _sizes_line(report: dict[str, Any]) -> str:
    s = report["config"]["sizes"]
    lo, hi = s["batch_prompt_len"]
    parts = [
        f"batch: {s['batch_prompts']} prompts of {lo}-{hi} random tokens, "
        f"{s['batch_output']} greedy tokens each",
        f"single: one stream of {s['single_output']} tokens after a {s['single_prompt_len']}-token prompt, "
        f"median of {s['single_repeats']} {_first_token_runs(report, s['single_repeats'])}",
    ]
    if "serve" in report["config"]["workloads"]:
        parts.append(
            f"serve: {s['serve_concurrency']} streaming clients, {s['serve_requests']} requests of "
            f"{s['serve_output']} tokens"
        )
    return "; ".join(parts)


def _first_token_runs(report: dict[str, Any], repeats: int) -> str:
    """How the run timed the first token: a median of one-token requests, or (older runs) one."""
    single = report.get("results", {}).get("single", {}).values()
    if any("first_token_run_seconds" in result for result in single):
        return f"(the first token: of {repeats} one-token requests)"
    return "(the first token: one one-token request)"


def _load_line(report: dict[str, Any]) -> str:
    loads = []
    for workload, peers in report["results"].items():
        for peer, entry in peers.items():
            before_after = entry.get("load_average_before_after")
            if before_after:
                loads.append(f"{workload}/{peer} {before_after[0][0]:.1f} -> {before_after[1][0]:.1f}")
    return ", ".join(loads) or "not recorded"


def machine_section(kind: str, report: dict[str, Any]) -> str:
    """Everything one report says: the machine, the run, every metric, our runner's counters."""
    machine, config = report["machine"], report["config"]
    versions = machine.get("versions", {})
    peers = [p for p in _report.PEERS if p in config["peers"]]
    baselines = [p for p in _report.BASELINES if p in peers]
    header = ["metric", *(_report.PEER_LABELS[p] for p in peers)]
    header += [f"ours / {_report.PEER_LABELS[p]}" for p in baselines] + ["better"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios = _report.ratios(report["results"])
    for metric in _report.METRICS:
        values = [_report.value(report["results"], metric, p) for p in peers]
        if all(v is None for v in values):
            continue
        cells = ["-" if v is None else _number(v) for v in values]
        for p in baselines:
            ratio = ratios[metric.label][f"xla/{p}"]
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        better = "higher" if metric.higher_is_better else "lower"
        rows.append(f"| {metric.label} | " + " | ".join(cells) + f" | {better} |")
    stats = _report.format_runner_stats(report["results"])
    failures = _report.format_failures(report["results"])
    dtypes = ", ".join(f"{peer} {dtype}" for peer, dtype in config["dtypes"].items() if peer in peers)
    parts = [
        f"## {kind}",
        "",
        f"- Machine: {machine['cpu_model']}, {machine['nproc']} CPUs, {machine['mem_total_gib']} GiB; "
        f"measured {machine['date']} (`benchmarks/results/throughput-{kind}.json`).",
        f"- Run: {_run_kind(report)} (`throughput.py{' --quick' if config.get('quick') else ''} "
        f"--peers {','.join(config['peers'])} --workloads {','.join(config['workloads'])}`); "
        f"{_sizes_line(report)}.",
        f"- dtypes: {dtypes}; versions: vllm-cpu {versions.get('vllm-cpu')}, jax {versions.get('jax')}, "
        f"torch {versions.get('torch')}, transformers {versions.get('transformers')}.",
        f"- Load average (1 min) before -> after each worker: {_load_line(report)}.",
        "",
        *rows,
        "",
    ]
    if stats:
        parts += ["Our runner's counters over each workload (after start-up):", ""]
        parts += [f"- {line}" for line in stats.splitlines()] + [""]
    if failures:
        parts += ["Failed or skipped:", "", "```", failures, "```", ""]
    return "\n".join(parts)


def planner_table(report: pathlib.Path = PLAN_JSON) -> str | None:
    """The planner's table when its `report` (`benchmarks/results/plan.json` or `plan-tp.json`)
    exists, rendered by `plan.py`.

    `benchmarks/plan.py` owns its format: it must define `render_markdown(report: dict) -> str`
    (the function behind its `--markdown` option)."""
    if not report.exists():
        return None
    if not PLAN_SCRIPT.exists():
        raise SystemExit(f"{report} exists but {PLAN_SCRIPT} does not: cannot render the planner's table")
    spec = importlib.util.spec_from_file_location("plan", PLAN_SCRIPT)
    plan = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(plan)
    render = getattr(plan, "render_markdown", None)
    if render is None:
        raise SystemExit(f"{PLAN_SCRIPT} has no render_markdown(report) -> str to render {report} with")
    return render(json.loads(report.read_text())).strip()


def planner_section(table: str | None, tp_table: str | None = None, draft_table: str | None = None) -> str:
    """The performance page's planner section: the tables, or lines saying none is committed."""
    body = NO_PLAN if table is None else PLANNER_INTRO + "\n" + table
    tp_body = NO_PLAN_TP if tp_table is None else PLANNER_TP_INTRO + "\n" + tp_table
    draft_body = ""
    if draft_table is not None:
        draft_body = "\n\n### With a draft beside the target\n\n" + PLANNER_DRAFT_INTRO + "\n" + draft_table
    return (
        "## What fits where: the planner\n\n"
        + body
        + "\n\n### Split over the chips of a host\n\n"
        + tp_body
        + draft_body
        + "\n\n"
        + PLANNER_PENDING
    )


def _measured_under(report: dict[str, Any]) -> str:
    (before, _, _), (after, _, _) = report["load_average_before_after"]
    return f"1-min load average {before:.1f} -> {after:.1f} on {report['nproc']} CPUs, {report['date']}"


def step_time_section(
    profile_path: pathlib.Path = STEP_PROFILE_JSON, host_path: pathlib.Path = HOST_CPU_JSON
) -> str:
    """The step-time section from the committed step profile and host CPU time reports."""
    if not profile_path.exists():
        return STEP_TIME_INTRO + "\nNo step profile is committed (`benchmarks/results/step_profile.json`).\n"
    profile = json.loads(profile_path.read_text())
    parts = ("dense", "attention", "rope+kv write", "activation", "other XLA")
    lines = [
        STEP_TIME_INTRO,
        f"Measured {_measured_under(profile)} ({profile['dtype']}, {profile['context']}-token contexts, "
        f"mean of {profile['steps']} steps):",
        "",
        "| rows | step wall ms | "
        + " | ".join(f"{p} busy ms" for p in parts)
        + " | host CPU ms (median) | dense share of busy |",
        "|" + "---|" * (len(parts) + 4),
    ]
    for row in profile["results"]:
        busy = row["busy_ms"]
        cells = [f"{busy.get(p, 0.0):.1f}" for p in parts]
        share = busy.get("dense", 0.0) / max(sum(busy.values()), 1e-9)
        lines.append(
            f"| {row['rows']} | {row['wall_ms']:.0f} | " + " | ".join(cells)
            + f" | {row['host_cpu_ms']:.2f} | {100 * share:.0f}% |"
        )  # fmt: skip
    if host_path.exists():
        host = json.loads(host_path.read_text())
        lines += [
            "",
            "Our host path per decode step through vLLM's engine, as CPU time of the engine's thread "
            "([`benchmarks/host_cpu_time.py`](../benchmarks/host_cpu_time.py): the thin model of "
            f"`host_overhead.py` in {host.get('dtype', 'float32')}, synchronous scheduling; "
            f"{_measured_under(host)}):",
            "",
            "| rows | host CPU ms | " + " | ".join(host["results"][0]["phases_ms"]) + " |",
            "|" + "---|" * (len(host["results"][0]["phases_ms"]) + 2),
        ]
        for row in host["results"]:
            cells = " | ".join(f"{v:.3f}" for v in row["phases_ms"].values())
            lines.append(f"| {row['rows']} | {row['decode_cpu_ms_per_step']:.2f} | {cells} |")
    return "\n".join(lines) + "\n"


def performance_page(
    runs: dict[str, dict[str, Any]],
    planner: str | None,
    planner_tp: str | None = None,
    planner_draft: str | None = None,
) -> str:
    """The whole page: method, every machine kind's figures, the planner's tables."""
    sections = [INTRO]
    if runs:
        sections.append("## Latest figures, all machine kinds\n\n" + readme_table(runs) + "\n")
    sections += [machine_section(kind, report) for kind, report in runs.items()]
    sections += device_sections(RESULTS)
    sections += [step_time_section(), attention_kernel_section(CPU_ATTENTION_JSON)]
    sections += [planner_section(planner, planner_tp, planner_draft), WHAT_MOVES]
    return "\n".join(s.rstrip("\n") + "\n" for s in sections)


def readme_with_table(readme: str, table: str, markers: tuple[str, str] = (TABLE_BEGIN, TABLE_END)) -> str:
    """`readme` with the text between `markers` replaced by `table`; an error without them."""
    begin_marker, end_marker = markers
    begin, end = readme.find(begin_marker), readme.find(end_marker)
    if begin < 0 or end < begin:
        raise SystemExit(f"README.md lacks the markers:\n{begin_marker}\n{end_marker}")
    return readme[: begin + len(begin_marker)] + "\n" + table + "\n" + readme[end:]


def render() -> dict[pathlib.Path, str]:
    """{path: the text it should hold} for README.md and docs/performance.md."""
    runs, planner, planner_tp = load_runs(), planner_table(), planner_table(PLAN_TP_JSON)
    readme = readme_with_table(README.read_text(), readme_table(runs, README_OWN_HEADLINE))
    readme = readme_with_table(readme, NO_PLAN if planner is None else planner, (PLAN_BEGIN, PLAN_END))
    tp_table = NO_PLAN_TP if planner_tp is None else planner_tp
    readme = readme_with_table(readme, tp_table, (PLAN_TP_BEGIN, PLAN_TP_END))
    page = performance_page(runs, planner, planner_tp, planner_table(PLAN_DRAFT_JSON))
    return {README: readme, PERFORMANCE: page}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a file differs from its render")
    args = parser.parse_args(argv)
    stale = []
    for path, text in render().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    verb = "differ from their render" if args.check else "rewritten"
    print(f"{verb}: {', '.join(str(p.relative_to(REPO)) for p in stale) or 'none'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
