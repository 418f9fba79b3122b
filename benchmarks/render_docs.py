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
# Rows of our int8 peer against our bfloat16 one, where a run has it (`--peers ...,xla-int8`).
INT8_HEADLINE = ("batch output tok/s", "single tok/s")
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


def _int8_pair(report: dict[str, Any], label: str) -> str:
    """`int8 / bfloat16 (ratio)` of our two peers for one metric, or '-' without an int8 run."""
    metric = METRIC_BY_LABEL[label]
    ratio = _report.ratios(report["results"])[label].get("xla-int8/xla")
    if ratio is None:
        return "-"
    int8, ours = (_report.value(report["results"], metric, peer) for peer in ("xla-int8", "xla"))
    return f"{_number(int8)} / {_number(ours)} (**{ratio:.2f}x**)"


def _run_kind(report: dict[str, Any]) -> str:
    return "quick sizes" if report["config"].get("quick") else "full sizes"


def readme_table(runs: dict[str, dict[str, Any]]) -> str:
    """One table: headline metrics in rows, ours / vLLM's CPU backend per machine kind in columns."""
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
    for label in INT8_HEADLINE:
        cells = [_int8_pair(runs[k], label) for k in kinds]
        if any(c != "-" for c in cells):
            row = f"ours int8 / ours as the model ships (embedded: Q4_1): {label} (higher is better)"
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
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
        f"median of {s['single_repeats']}",
    ]
    if "serve" in report["config"]["workloads"]:
        parts.append(
            f"serve: {s['serve_concurrency']} streaming clients, {s['serve_requests']} requests of "
            f"{s['serve_output']} tokens"
        )
    return "; ".join(parts)


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


PLANNER_INTRO = """\
What one chip of each compile-only target holds and how fast a decode step could be, from
[`benchmarks/plan.py`](../benchmarks/plan.py): the runner's decode and prefill steps and its
sampler compiled by the target's real compiler with abstract weights, the KV cache sized to the
memory left (`--memory-utilization`, as vLLM's `gpu_memory_utilization`). Columns: the weights
as served (the model's dtype, or `int8`: `--quantization int8_per_channel_weight_only`, every
dense kernel int8 with a float32 scale per output channel, the embedding table and activations
in the model's dtype), their bytes per chip, the KV cache that fits (GiB and tokens), the
steps' temporary memory, whether the batch's full context fits, and three decode-step times: the
roofline (weights and the batch's KV read once at peak bandwidth), XLA's cost model (it does not
count what happens inside a Mosaic or Triton kernel, so it can come out below the roofline), and
the bytes the optimized program's instructions move at peak bandwidth (an upper bound: a kernel
is charged every operand it takes whole). None of them is a measurement.
"""


PLANNER_TP_INTRO = """\
The same, for a model split over the chips of one host (`benchmarks/plan.py --tp`, the runner's
`--tensor-parallel-size`): the weights placed by the rules table of `models/sharding.py`, the KV
cache split on its heads, every figure per chip. The last column counts the collectives of the
compiled decode step and the bytes they give: per layer two all-reduces of the `[tokens, hidden]`
activations, one for the embedding, and the logits gathered once (`tests/aot` fails a sharded
step that exchanges anything else). The roofline and XLA's cost model leave that exchange out.
A "DP D x TP N" row is D data-parallel replicas of N chips each (`--dp D`, the runner's
`--data-parallel-size`): each replica compiles the N-chip program, so the row is that program's
chip, with one replica's KV tokens and those of all D, and the throughput of all D. With ", EP"
the experts are split over all D x N chips with attention per replica: refused at start
([architecture.md](architecture.md#data-parallelism)), so its chip is arithmetic
(`tpu_platform/planner/replicas.py`) and its steps' memory that of the program compiled with the
experts over the same chips and attention split over them too.
"""


PLANNER_PENDING = """\
### Rows planned from few layers

A row marked "(from 2+4 layers)" was planned with `benchmarks/plan.py --depth`, on a machine too
busy for whole-model compiles: the model's first 2 and 4 layers compiled at full width (past a
leading run of dense layers, later; the planner now compiles a routed-experts model's decode step
at a third depth too, which the committed MoE rows predate, so their decode need may read
high), the weights and every layer's KV
cache exact arithmetic, what the steps need beyond them extrapolated to every layer
(`tpu_platform/planner/depth.py`, as `make test` checks the models it compiles). Its temporary
column is that extrapolated need (temporaries, outputs not aliasing the cache, code), its decode
collectives are extrapolated alike, and it has no cost-model figure (a short program's is not the
model's).

- GPT-OSS is planned with its mxfp4 experts, as released. Before the routed experts ran their
  tiles in chunks, GPT-OSS-120B's 2k-token prefill on v6e-8 gathered and decoded every tile's
  expert at once (3.2 GB of temporaries a chip for two layers, 0.36 GB now), and with bfloat16
  experts no cache size fitted.
- GLM-4.5-Air does not fit v6e-4 at TP=4: its bfloat16 weights alone take 53.5 GB a chip. On
  8x H100 at TP=4 its prefill held 10.2 GiB beyond weights and cache (and 11.0 GiB of KV a chip
  fitted) until each chunk of expert tiles gathered its own rows inside the loop
  ([models.md](models.md)).
- Qwen3-Next-80B-A3B (hybrid: three Gated DeltaNet layers before each gated attention one) is
  planned from its first 4 and 8 layers, whole runs of that pattern. Its pages are raised until
  one holds a layer's state (512 tokens on 8x H100), and a page's bytes count a request's states
  beside the KV (9.2 MiB of states a request, 12 KiB of KV a token, a chip), so its KV column is
  both; its decode roofline reads and writes each request's states once. On v6e-8 (pages of 272
  tokens) its bfloat16 weights take 18.7 GiB of a chip's 32, leaving 8.1 GiB of pages. Each of
  the 64 requests holds one page in each of the three state groups, and the other 475 pages hold
  129k tokens, just short of 64 sequences of 2048.
- gemma-4-26B-A4B fits one v6e chip only with int8 weights (in bfloat16 they alone take about
  50 GB): 24.95 GiB of weights leave 2.4 GiB of KV, 5266 tokens, since every layer's cache has
  the full layers' head dim of 512 and the sliding layers' 8 KV heads ([models.md](models.md)).
- Qwen3-235B-A22B at EP=16 on a v6e-16 slice (4 hosts; expert parallelism across hosts is refused
  at start, so this is the program such a slice would run): in bfloat16 its weights take 27.6 GiB
  a chip (8 whole experts a layer, 26.4 GiB of them), and the 1.2 GiB left of the budget is less
  than the 1.9 GiB its steps need beyond weights and cache, so no KV cache fits; with int8 weights
  13.9 GiB a chip leave 11.5 GiB of KV cache (257k tokens).
- DeepSeek-V3 fits a v6e-8 in no format: in int4 with a scale per 128 inputs, the fewest bytes,
  its weights alone take 42.6 GiB a chip. Its step with block-fp8 weights (as released), cut to
  four layers at full width (one dense, three MoE), compiles for v6e-8 at TP=8 and fits
  (`tests/aot/test_v6e8_big_models.py`): 4.7 GiB of weights a chip, the latent cache whole on
  every chip and updated in place, temporaries of 0.9 GiB (decode) and 1.8 GiB (prefill) beside
  a 22 GiB cache, the collectives the rules table implies.
"""


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


PLANNER_DRAFT_INTRO = """\
Speculative decoding serves its drafter on the target's chip, or split over the target's chips
as the target is (`speculative_config`, [configuration.md](configuration.md); with `--tp N` the
rows are a chip's share): `plan.py --draft` takes the drafter's weights out of the
KV budget, then gives each target page a page of the drafter's cache beside it, as the worker
does. Rows planned from the model's first layers (`--depth`), batch 16 x 4096 tokens: the KV
tokens the target holds alone and with the drafter (a Llama-3.2-1B draft model, or an EAGLE-3
head of the released heads' shape: one layer as wide as the target, a 32000-token draft
vocabulary). The TPU cache layout holds a head of 64 in 128 lanes, so a draft with such heads
costs twice its bytes a page there.
"""


INTRO = """\
# Performance

<!-- Written by benchmarks/render_docs.py from benchmarks/results/*.json: edit the script or
rerun the benchmark, not this page. -->

The latest end-to-end figures, one section per machine kind, each from one run of
[`benchmarks/throughput.py`](../benchmarks/throughput.py) (its options and workloads:
[`benchmarks/README.md`](../benchmarks/README.md)). End-to-end serving is measured on CPUs only;
one NVIDIA H200 ran the kernels and a model step ([its section](#on-a-gpu-nvidia-h200)), and
nothing has run on a TPU ([kernels.md](kernels.md#support-matrix)). For TPU and GPU targets the
[planner's section](#what-fits-where-the-planner) gives compiler estimates and rooflines, not
measurements.

## Method

- Every peer serves the embedded SmolLM2-135M-Instruct with the same dequantized weights, in one
  run on one machine, each (peer, workload) in its own subprocess: ours is vLLM on vllm-xla
  (`VLLM_XLA_PLATFORM=cpu`), the baseline vLLM's own CPU backend (`vllm-cpu`), optionally
  transformers' `generate`.
- Start-up (engine build, compilation or the executable cache) is timed apart and never enters
  tokens per second; a short warm-up request runs first.
- The machines are shared with other jobs and noisy: **read the ratios of one run**, not absolute
  figures across runs or machines. The load average before and after each worker is recorded
  beside the figures; a peer that shares the cores with another job loses more than the ratio's
  precision.
- To refresh a machine kind: run the benchmark, copy its JSON to
  `benchmarks/results/throughput-<kind>.json`, run `benchmarks/render_docs.py`, commit all three.
  Earlier figures are that file's history in git (`git log -p benchmarks/results/`).
- To check a run for regressions: `benchmarks/compare.py check <run>.json` names every figure
  that dropped past the committed run's run-to-run noise and exits 1; the noise comes from
  repeated runs merged by `benchmarks/compare.py noise` ([README](../benchmarks/README.md)).
"""

STEP_TIME_INTRO = """\
## Where a batch step spends its time

A decode step of the embedded model on the CPU device, from a JAX profiler trace of the runner
serving it ([`benchmarks/step_profile.py`](../benchmarks/step_profile.py), greedy, no vLLM
engine): the busy milliseconds of each part summed over XLA's threads (two cores can make them
add up to more than the step's wall time), and our host path's CPU time on the engine's thread.
A greedy step runs no sampler program (the forward's argmax serves it); a sampling step adds one
small program on the `[rows, vocabulary]` logits. A loaded machine stretches every wall time and
busy time alike (other jobs take the cores mid-operation): read the parts' shares.
"""


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


WHAT_MOVES = """\
## What moves the figures

- **Dense layers.** On CPU a bfloat16 model's projections run in a native kernel on AMX tiles,
  AVX-512 BF16 or AVX2 (the best the CPU has; [kernels.md](kernels.md#native-dense-layers)); a
  float32 model's run natively on AVX2-only CPUs. Decode steps of many rows and prefill are bound
  by these. Without a C++ compiler everything stays on XLA's dots and attention
  ([troubleshooting.md](troubleshooting.md#no-c-compiler)).
- **Memory traffic.** A single stream reads every weight once a token, and decode attention reads
  each sequence's KV pages: both run near the memory system's rate. Fewer bytes move them: a
  bfloat16 model, a float8 KV cache (`--kv-cache-dtype fp8`), 128-token pages on CPU.
- **Padding.** Tokens per step are padded to a bucket; padding rows are skipped by the dense
  kernels, but a badly chosen `--max-num-batched-tokens` still prefills in large, slow steps.
  Smaller steps bound the stalls other streams see ([configuration.md](configuration.md)).
- **Host time per step.** Ours is reported as `vllm_xla:host_seconds_per_step`
  ([metrics.md](metrics.md)), by `benchmarks/host_overhead.py` (wall time, the device's threads
  off the engine's core) and by `benchmarks/host_cpu_time.py` (CPU time, phase by phase); on TPU
  and GPU it is hidden behind the device step by vLLM's async scheduling. Measured as CPU time it
  is the same today as before LoRA, pooling, int8 and speculative decoding were served (a request
  that uses none of them adds no per-step work for them). The same host code costs three to
  seven times more CPU time in the engine than in a loop of its own (input preparation, the
  runtime's execute call), most likely because the forward and other jobs between two steps leave
  it cold caches. On 2026-11-29, in alternating runs of the tree before and after at the same
  load (1-min load average 11 to 15 on 2 CPUs, medians of 3 runs), it went from 1.50 and 1.55 to
  1.41 and 1.37 ms at 64 rows, and from 2.00 to 1.79 ms at 256 rows: the forward's packed inputs
  are passed as the device array that already reads their reused host buffer
  (`dispatch.HostViews`: the `input transfer` phase, 0.11-0.13 ms, is gone); a step reads the
  runner's phase records once; a greedy step skips the sampler's seeding counts; one host skips the
  lost-host error context. That is still above the 0.5 ms goal. The runtime's execute call
  (0.4 ms at 64 rows) is the launch alone: a profile of the engine's thread in steady decode
  (`perf` attached after warm-up, 64 rows) finds no kernel of the program run on it, and a third
  of the call in PJRT's per-argument preparation, more in per-buffer usage events.
  [`benchmarks/call_cost.py`](../benchmarks/call_cost.py) times the same call in a loop of its
  own at about 0.15 us of CPU an argument (35 us for the forward's ~190 arrays); in the engine,
  between forwards that leave the caches cold, it is ten times that. Fewer arrays cut it: a
  prototype passing the thin model's 184 weights as 8 arrays stacked by shape (11 arguments, not
  187) took the host time at 64 rows from 1.21 and 1.28 to 0.92 and 0.98 ms (the execute phase
  from 0.38-0.39 to 0.18-0.19 ms), at 256 rows from 1.74 and 1.51 to 1.51 and 1.51 ms (execute
  0.43-0.50 to 0.30 ms), in two alternating pairs of `host_cpu_time.py` runs (medians of 3) at a
  1-min load average of 5.5 to 7 on 2 CPUs; two pairs at 8 to 10 moved the execute phase alike
  (0.38-0.50 to 0.26-0.29 ms at 64 rows), the host time within their noise (2026-11-29).
  Every way XLA:CPU takes a layer's weights out of a stack copies them
  ([`benchmarks/stacked_weights.py`](../benchmarks/stacked_weights.py), at the embedded model's
  sizes: static slices copy every weight at every step, 2.5 times the step's time; a `lax.scan`
  one layer at a time, 1.2-1.3 times), with XLA's dots and the native dense kernel alike. On the
  compile-only targets a scan fuses its slices on TPU but copies each layer on GPU, where static
  slices fuse into the matmuls and compile eight times slower. So the native dense kernels take
  the stack and the layer's index (`layer=`) and read the layer in place: `stacked_weights.py`'s
  `stack + index` program copies no weight and needs the temp memory of per-layer arguments, and
  30 such layers at 64 rows took the same CPU time a step as per-layer arguments (82 and 84 ms,
  medians of 30 alternating steps, 1-min load average 27 to 47 on 2 CPUs, 2026-11-29). On one
  device a uniform decoder's packed projections and norms are served stacked
  (`models.layer_stacks`: bfloat16, int8 and int4 kernels; a tensor-parallel split keeps
  per-layer arrays): the thin model's step takes 13 arguments instead of 187 (10 weight arrays,
  one KV-cache array that every layer has shared since the caches were stacked, the packed
  inputs, the fed tokens), so the execute call has few arguments left to drop. The thin model
  in bfloat16 (`host_cpu_time.py --dtype bfloat16`, its 121 kernels
  native) went from 1.42 and 1.32 to 1.12 and 1.09 ms at 64 rows (execute 0.43-0.45 to
  0.22-0.24 ms), from 1.73 and 1.47 to 1.58 and 1.18 ms at 256 rows (execute 0.39-0.46 to
  0.23-0.29 ms), in alternating
  runs (medians of 3) at a 1-min load average of 8 to 41 on 2 CPUs (2026-11-29).
  Under async scheduling (`host_cpu_time.py --async-scheduling`, 1-min load average 15 to 21 on
  2 CPUs, 2026-11-29) the figures were 1.07 ms at 64 rows and 1.73 ms at 256, the execute phase
  about the same; the rest is some 30 small NumPy operations of input preparation and token
  recording, and Python. Each of those costs several times its time in a loop of its own: a
  64-element scatter of the sampled tokens into the history took 30-130 us in the engine (no
  page fault, no context switch) and 4 us in a loop; a `perf` profile of the engine's thread in
  steady decode (1-min load average 20-30, memory pressure on the machine) spent 22% of its CPU
  in the kernel (reclaim, file read-ahead of evicted pages), 57% in the Python interpreter.
  Fewer NumPy operations a decode step (no feed comparison while no token is in flight, block
  rows and lengths written in place) took the table work of a 64-row step from 113-149 to
  88-112 us in a loop that evicts the caches between steps (3 alternating pairs). In the engine
  it is within the noise of alternating runs (1-min load average 18 to 35 on 2 CPUs); the trees
  run side by side at 256 rows took 1.42 against 1.48 ms, input preparation 0.19 against 0.22 ms
  and the unchanged phases alike (1-min load average 27, 2026-11-29).
- **Async scheduling on the CPU device** stays off by default (`VLLM_XLA_CPU_ASYNC_SCHEDULING=1`
  turns it on). On the CPU device the "device" is the host's own cores: a decode step of many rows
  is bound by the dense kernels (the section above), and in a synchronous run of the full batch
  workload 0.9% of the wall time lies outside the device's step (vLLM's scheduling and output
  processing, and our host path): all that overlapping could hide. Overlapping takes that time
  from the cores the step computes on, and a newly arrived request waits one more whole step for
  its first token. Two alternating off/on pairs of that workload on 2026-11-28 (1-min load
  average 13 to 25 on 2 CPUs) gave async/sync ratios of 2.0 and 0.76, each run faster where
  the machine's load had fallen: the overlap itself is not measurable against that noise.
- **Start-up.** Compiled programs are kept in an executable cache; a warm start loads them
  instead of compiling ([architecture.md](architecture.md#compilation-and-caches)).
"""


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
    readme = readme_with_table(README.read_text(), readme_table(runs))
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
