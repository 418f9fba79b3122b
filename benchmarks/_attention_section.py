# SPDX-License-Identifier: Apache-2.0
"""docs/performance.md's section on the native CPU attention kernel alone, from the committed
`results/cpu_attention.json` (`benchmarks/cpu_attention.py`; a `before` list beside `results`:
the same cases on the kernel before a change, measured in the same session, alternating)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

INTRO = """### The attention kernel alone

[`benchmarks/cpu_attention.py`](../benchmarks/cpu_attention.py) times the native attention at the
embedded model's shapes (9 query heads, 3 kv heads, head dim 64, 128-token pages), each case a
chain of calls over distinct layers' caches. GFLOP/s are per second of process CPU time (what a
core does; other jobs' time slices do not stretch it), against a core's roofline: min(peak,
FLOPs a byte x the bytes a CPU second one thread reads of a 256 MB buffer). "streamed": enough
layers to pass 96 MB of cache, so the pages come from memory as in a model step (from the
last-level cache where it holds more: the Xeon kind's holds 300 MB); "2 layers": the pages stay
in cache, which shows the kernel's arithmetic apart from memory. "before": the same case on the
kernel before its last change, run in the same session alternating with it, each side the run
with the median CPU-second figure of three (wall times on a loaded machine vary several-fold; the
CPU-second figures less, but a prefill case's still by up to 1.3x between runs of one build).
"""


def _key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return row["case"], row["dtype"], row["kv_dtype"], row.get("mode", "streamed")


def attention_kernel_section(path: pathlib.Path) -> str:
    """The section, or a line saying no report is committed."""
    if not path.exists():
        return INTRO + "\nNo report is committed (`benchmarks/results/cpu_attention.json`).\n"
    report = json.loads(path.read_text())
    machine = report["machine"]
    before = {_key(row): row for row in report.get("before", [])}
    lines = [
        INTRO,
        f"Measured {machine['time']}, 1-min load average {machine['load'][0]:.1f} -> "
        f"{machine['load'][1]:.1f} on {machine['cpus']} CPUs; a core's roofline "
        f"{machine['peak_gflops']:.0f} GFLOP/s, {machine['read_gb_s']:.1f} GB/s:",
        "",
        "| case | rows / cache | mode | ms a call | GFLOP/s a CPU second | of roofline | before | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        old = before.get(_key(row))
        gflops, share = row["gflops_per_cpu_s"], row["gflops_per_cpu_s"] / row["roofline_gflops"]
        then = f"{old['gflops_per_cpu_s']:.1f}" if old else "-"
        ratio = f"{gflops / old['gflops_per_cpu_s']:.2f}x" if old else "-"
        lines.append(
            f"| {row['case']} | {row['dtype']} / {row['kv_dtype']} | {row.get('mode', 'streamed')} | "
            f"{row['wall_s'] * 1e3:.2f} | {gflops:.1f} | {share:.0%} | {then} | {ratio} |"
        )
    return "\n".join(lines) + "\n"
