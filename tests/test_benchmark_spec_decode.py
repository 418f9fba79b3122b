# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/spec_decode.py`'s bookkeeping, without engines: each round's ratio pairs a
configuration with no speculation's run of the same round, the rounds rotate the configurations'
order, and the outputs' comparison counts requests (the control included)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

spec_decode = load_benchmark("spec_decode")


def _run(wall: float, tokens: int = 100, outputs=((1, 2),), spec=None) -> dict:
    listed = [list(o) for o in outputs]
    return {"wall_s": wall, "output_tokens": tokens, "outputs": listed, "spec": spec or {}, "sample_text": ""}


def test_each_round_is_paired_with_no_speculations_run_of_the_same_round():
    off = [_run(2.0), _run(4.0), _run(2.0)]
    spec = [_run(1.0), _run(2.0), _run(4.0)]  # 2x, 2x, then 0.5x: a slow minute hit this one alone
    figures = spec_decode._figures(spec, off)
    assert figures["speedup"] == 2.0
    assert figures["speedup_range"] == [0.5, 2.0]
    assert figures["wall_s"] == 2.0 and figures["output_tokens_per_s"] == 50.0
    # Unpaired, the medians of each side would say 1.0x.
    assert spec_decode._figures(off, None)["wall_s"] == 2.0


def test_acceptance_counts_every_rounds_drafts():
    runs = [_run(1.0, spec={"drafts": 2, "draft_tokens": 8, "accepted_tokens": 6}) for _ in range(3)]
    figures = spec_decode._figures(runs, None)
    assert figures["drafted_tokens"] == 24 and figures["accepted_tokens"] == 18
    assert figures["acceptance_rate"] == 0.75
    assert figures["mean_acceptance_length"] == 1 + 18 / 6


class _Recorder:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def run(self, workload: str) -> dict:
        self.calls.append((self.name, workload))
        return _run(1.0)


def test_rounds_rotate_which_configuration_runs_first():
    calls: list = []
    workers = {name: _Recorder(name, calls) for name in ("off", "ngram", "ngram_per_batch")}
    runs = spec_decode._rounds(workers, ["single", "batch"], repeats=3)
    firsts = [calls[i][0] for i in range(0, len(calls), 3)]
    assert firsts == ["off", "off", "ngram", "ngram", "ngram_per_batch", "ngram_per_batch"]
    assert all(len(runs[name][w]) == 3 for name in workers for w in ("single", "batch"))


def test_the_summary_counts_requests_whose_outputs_differ_and_the_control():
    def runs(single, batch):
        return {"single": [_run(1.0, outputs=single)], "batch": [_run(1.0, outputs=batch)]}

    off = runs(single=[(1, 2), (3, 4)], batch=[(1, 2), (3, 5), (6,)])  # a shape-dependent request
    spec = runs(single=[(1, 2), (3, 4)], batch=[(1, 2), (3, 4), (6,)])
    summary, results = spec_decode._summarize({"off": off, "ngram": spec}, ("off", "ngram"), "ngram")
    assert summary["single_outputs_identical"] and summary["single_outputs_differing"] == 0
    assert summary["batch_outputs_differing"] == 1 and not summary["batch_outputs_identical"]
    assert summary["off_single_vs_batch_differing"] == 1
    assert [r["config"] for r in results] == ["off", "ngram"]


def test_a_schedule_is_first_last_k_ranges():
    schedule = load_benchmark("_spec_decode_worker").per_batch_size("1-4:4,5-64:1")
    assert schedule == [[1, 4, 4], [5, 64, 1]]
    with pytest.raises(ValueError, match="first-last:k"):
        spec_decode.per_batch_size("1:4")
