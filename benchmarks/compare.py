# SPDX-License-Identifier: Apache-2.0
"""A throughput run against the committed one for its machine kind: names every metric that got
worse by more than the run-to-run noise measured on that kind, and exits 1 when one did (2 when
the runs cannot be compared: other sizes, limits or dtypes, or no baseline).

    .venv/bin/python benchmarks/compare.py check NEW.json [--baseline PATH | --kind KIND]
        [--min-noise 0.05]
    .venv/bin/python benchmarks/compare.py noise RUN1.json RUN2.json [...] --out MERGED.json

`check` reads every metric of `_report.METRICS` for every peer both runs measured, and every
ratio of ours to a peer (`_report.ratios`, the figure a loaded machine moves least). A metric
regressed when it moved the wrong way (lower throughput, higher latency or time) by more than its
noise: the relative spread stored in the baseline's (and the new run's) `noise` section, never
below `--min-noise`. The baseline is `--baseline`, or `benchmarks/results/throughput-KIND.json`
for `--kind`, or the committed run whose machine has the new run's CPU model and CPU count.

`noise` merges repeated runs of `throughput.py` (same options, same machine) into one report: the
first run's figures, plus a `noise` section holding, per metric, the spread of the runs
((max - min) / median) and the number of runs. Commit that report as the machine kind's baseline.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _report  # noqa: E402

RESULTS = HERE / "results"
DEFAULT_MIN_NOISE = 0.05  # below this a spread of two or three runs says little


def figures(report: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    """{metric name: (value, higher is better)} of every figure `report` measured: each peer's
    metric as `"<label> [<peer>]"`, each ratio of ours to a peer as `"<label> [xla/<peer>]"`."""
    results = report["results"]
    out: dict[str, tuple[float, bool]] = {}
    for metric in _report.METRICS:
        for peer in _report.PEERS:
            value = _report.value(results, metric, peer)
            if value is not None:
                out[f"{metric.label} [{peer}]"] = (value, metric.higher_is_better)
        for pair, ratio in _report.ratios(results)[metric.label].items():
            if ratio is not None:
                out[f"{metric.label} [{pair}]"] = (ratio, metric.higher_is_better)
    return out


def spread(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Per figure measured by every one of `reports`: (max - min) / median."""
    by_run = [figures(r) for r in reports]
    common = set(by_run[0]).intersection(*by_run[1:])
    out = {}
    for name in sorted(common):
        values = [run[name][0] for run in by_run]
        middle = statistics.median(values)
        out[name] = (max(values) - min(values)) / abs(middle) if middle else 0.0
    return out


def merge_runs(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The first of `reports` with the runs' spread stored as its `noise` section."""
    if len(reports) < 2:
        raise ValueError("noise needs at least two runs of the same benchmark")
    configs = {json.dumps(r["config"], sort_keys=True) for r in reports}
    if len(configs) > 1:
        raise ValueError("the runs differ in their config (peers, workloads or sizes); rerun alike")
    return {**reports[0], "noise": {"runs": len(reports), "relative_spread": spread(reports)}}


# Config fields two runs must share for their figures to be compared (peers and workloads may
# differ: only the figures both measured are compared).
COMPARABLE = ("quick", "sizes", "vllm_limits", "dtypes")


def config_differences(baseline: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The `COMPARABLE` config fields in which the two runs differ."""
    old, now = baseline.get("config", {}), new.get("config", {})
    return [key for key in COMPARABLE if old.get(key) != now.get(key)]


def _noise_of(report: dict[str, Any]) -> dict[str, float]:
    return report.get("noise", {}).get("relative_spread", {})


def regressions(
    baseline: dict[str, Any], new: dict[str, Any], min_noise: float = DEFAULT_MIN_NOISE
) -> list[dict[str, Any]]:
    """Every figure of both runs that moved the wrong way by more than its noise, worst first:
    {name, baseline, new, change (relative, signed), noise}."""
    old_figures, new_figures = figures(baseline), figures(new)
    old_noise, new_noise = _noise_of(baseline), _noise_of(new)
    found = []
    for name in sorted(set(old_figures) & set(new_figures)):
        (before, higher_is_better), (after, _) = old_figures[name], new_figures[name]
        if not before:
            continue
        change = (after - before) / abs(before)
        worse = -change if higher_is_better else change
        noise = max(min_noise, old_noise.get(name, 0.0), new_noise.get(name, 0.0))
        if worse > noise:
            found.append({"name": name, "baseline": before, "new": after, "change": change, "noise": noise})
    return sorted(found, key=lambda r: -abs(r["change"]) / r["noise"])


def find_baseline(new: dict[str, Any], results: pathlib.Path = RESULTS) -> pathlib.Path:
    """The committed run of `new`'s machine kind: same CPU model and CPU count (ValueError naming
    the candidates when none or several match)."""
    machine = new["machine"]
    key = (machine.get("cpu_model"), machine.get("affinity"))
    paths = sorted(results.glob("throughput-*.json"))
    matching = []
    for path in paths:
        other = json.loads(path.read_text())["machine"]
        if (other.get("cpu_model"), other.get("affinity")) == key:
            matching.append(path)
    if len(matching) != 1:
        names = ", ".join(p.stem.removeprefix("throughput-") for p in (matching or paths)) or "none"
        raise ValueError(
            f"{len(matching)} committed runs match {key[0]!r} with {key[1]} CPUs (kinds: {names}); "
            "name one with --kind or --baseline"
        )
    return matching[0]


def format_report(found: list[dict[str, Any]], baseline: pathlib.Path, compared: int) -> str:
    if not found:
        return f"no regression against {baseline} ({compared} figures compared)"
    lines = [f"{len(found)} of {compared} figures regressed against {baseline}:"]
    for r in found:
        lines.append(
            f"  {r['name']}: {r['baseline']:.4g} -> {r['new']:.4g} "
            f"({100 * r['change']:+.1f}%, noise {100 * r['noise']:.1f}%)"
        )
    return "\n".join(lines)


def _refuse(message: str) -> SystemExit:
    """Exit status 2 (nothing compared), apart from 1 (a regression)."""
    print(f"compare.py: {message}", file=sys.stderr)
    return SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="compare a run with its machine kind's committed run")
    check.add_argument("new", help="throughput.py's JSON")
    where = check.add_mutually_exclusive_group()
    where.add_argument("--baseline", help="the JSON to compare against")
    where.add_argument("--kind", help="machine kind: benchmarks/results/throughput-KIND.json")
    check.add_argument("--min-noise", type=float, default=DEFAULT_MIN_NOISE, help="relative floor")
    noise = commands.add_parser("noise", help="merge repeated runs, storing their spread")
    noise.add_argument("runs", nargs="+", help="throughput.py JSONs of the same options and machine")
    noise.add_argument("--out", required=True, help="the merged JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "noise":
        try:
            merged = merge_runs([json.loads(pathlib.Path(p).read_text()) for p in args.runs])
        except ValueError as e:
            raise _refuse(str(e)) from e
        pathlib.Path(args.out).write_text(json.dumps(merged, indent=2, default=str))
        spreads = merged["noise"]["relative_spread"]
        worst = max(spreads.items(), key=lambda kv: kv[1], default=("-", 0.0))
        print(f"wrote {args.out}: {len(spreads)} figures, largest spread {worst[0]} {100 * worst[1]:.1f}%")
        return 0
    new = json.loads(pathlib.Path(args.new).read_text())
    try:
        if args.baseline:
            baseline = pathlib.Path(args.baseline)
        elif args.kind:
            baseline = RESULTS / f"throughput-{args.kind}.json"
        else:
            baseline = find_baseline(new)
    except ValueError as e:
        raise _refuse(str(e)) from e
    if not baseline.exists():
        raise _refuse(f"no committed run at {baseline}")
    old = json.loads(baseline.read_text())
    differences = config_differences(old, new)
    if differences:
        raise _refuse(
            f"the run differs from {baseline} in its config ({', '.join(differences)}); "
            "compare runs of the same sizes (--quick or not), limits and dtypes"
        )
    found = regressions(old, new, args.min_noise)
    print(format_report(found, baseline, len(set(figures(old)) & set(figures(new)))))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
