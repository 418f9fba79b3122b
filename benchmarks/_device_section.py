# SPDX-License-Identifier: Apache-2.0
"""docs/performance.md's accelerator sections, from `benchmarks/results/device_check-*.json`.

Each file holds `benchmarks/device_check.py` reports of one device kind: `first` (the whole
check) and, where a second run was made, `second` (the step program and the tuning sweep again,
each timing also taken with calls queued back to back). Used by `render_docs.py`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def attention_table(rows: list[dict[str, Any]]) -> str:
    """Each case: the Pallas kernel's and XLA's time (each call waited for) and the kernel's error."""
    by_case: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["backend"]] = row
    lines = [
        "| case | tokens / cached | Pallas ms | XLA ms | XLA / Pallas | Pallas max abs error |",
        "|---|---|---|---|---|---|",
    ]
    for case, backends in by_case.items():
        pallas = next((r for b, r in backends.items() if b != "xla"), None)
        xla = backends.get("xla")
        if pallas is None or xla is None or "error" in pallas:
            continue
        ratio = xla["median_seconds"] / pallas["median_seconds"]
        sizes = f"{pallas['tokens']} / {pallas['kv_tokens']}"
        lines.append(
            f"| {case} | {sizes} | {_ms(pallas['median_seconds'])} | {_ms(xla['median_seconds'])} "
            f"| {ratio:.1f}x | {pallas['max_abs_error']:.1e} |"
        )
    return "\n".join(lines)


def step_table(first: dict[str, Any], second: dict[str, Any] | None) -> str:
    """The step program's times beside the decode roofline (weights and KV read once)."""
    lines = [
        "| step | ms, each waited for | ms, queued | tokens/s (queued) | roofline ms | roofline / queued |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in first["steps"].items():
        again = (second or {}).get("steps", {}).get(name, {})
        queued = again.get("pipelined_seconds")
        roofline = row.get("roofline", {}).get("seconds")
        count = int(name.split("_")[1])  # decode_<sequences>, prefill_<tokens>
        rate = f"{count / queued:.0f}" if queued else "-"
        share = f"{roofline / queued:.0%}" if roofline and queued else "-"
        lines.append(
            f"| {name} | {_ms(row['median_seconds'])} | {_ms(queued)} | {rate} | {_ms(roofline)} | {share} |"
        )
    return "\n".join(lines)


def sweep_lines(rows: list[dict[str, Any]]) -> str:
    """Per kernel and case: the default tuning's queued time and the fastest tuning's."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        timed = [r for r in rows if r["case"] == case and "pipelined_seconds" in r]
        default = next((r for r in timed if r["tuning"] == "default"), None)
        best = min(
            (r for r in timed if r["tuning"] != "default"), key=lambda r: r["pipelined_seconds"], default=None
        )
        if default and best:
            knobs = ", ".join(f"{k}={v}" for k, v in best["tuning"].items())
            lines.append(
                f"- {case}: default {_ms(default['pipelined_seconds'])} ms, fastest "
                f"{_ms(best['pipelined_seconds'])} ms ({knobs}) of {len(timed) - 1} tunings"
            )
    return "\n".join(lines)


def device_sections(results: pathlib.Path) -> list[str]:
    """One section per `device_check-<kind>.json` in `results`."""
    sections = []
    for path in sorted(results.glob("device_check-*.json")):
        report = json.loads(path.read_text())
        first, second = report["first"], report.get("second", {})
        device = first["device"]
        rows = first["attention"] + first.get("variants", [])
        text = [
            f"## On a GPU: {device['kind']}\n",
            f"`benchmarks/device_check.py`, JAX {device['jax']}, random weights and inputs "
            f"({path.relative_to(results.parent.parent)}): {report['note']}\n",
            "Attention, bfloat16, against the float32 reference; decode = one query for each of the "
            f"sequences, prefill = chunks of 512 queries:\n\n{attention_table(rows)}\n",
        ]
        if isinstance(first.get("step"), dict) and "steps" in first["step"]:
            step = first["step"]
            text.append(
                f"The one-chip step program of a {step['model']} of {step['layers']} layers "
                f"(Llama-3.1-8B's shape), {step['context']} tokens a decode sequence, "
                f"backend {step['backend']}:\n\n"
                f"{step_table(step, second.get('step'))}\n"
            )
        if second.get("sweep"):
            text.append(f"The GPU kernels' tuning sweep (queued ms):\n\n{sweep_lines(second['sweep'])}\n")
        sections.append("\n".join(text))
    return sections
