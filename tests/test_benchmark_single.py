# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/_peers._measure_single`: the first token is the median of several one-token
requests, not one (a short request is easily moved by a time slice lost to another job), and
every timed request, first tokens and streams alike, has a prompt of its own (no prefix-cache
hit between them)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def peers():
    return load_benchmark("_peers", register=True)  # its Sizes dataclass looks itself up


def test_first_token_is_the_median_of_one_token_requests_on_new_prompts(peers):
    sizes = peers.Sizes(
        batch_prompts=2, batch_prompt_len=(4, 8), batch_output=4, single_prompt_len=6, single_output=5,
        single_repeats=3, warmup_prompt_len=4, warmup_output=2, serve_requests=2, serve_concurrency=1,
        serve_prompt_len=(4, 8), serve_output=2,
    )  # fmt: skip
    calls = []
    first_token_times = iter([0.050, 0.020, 0.030])  # one slow request among three
    stream_times = iter([1.0, 1.2, 1.1])

    def generate(prompts, max_tokens):
        calls.append((tuple(prompts[0]), max_tokens))
        seconds = next(first_token_times) if max_tokens == 1 else next(stream_times)
        return seconds, [max_tokens]

    result = peers._measure_single(generate, 1000, sizes)
    assert [n for _, n in calls] == [1, 1, 1, 5, 5, 5]
    assert len({prompt for prompt, _ in calls}) == 6 and all(len(p) == 6 for p, _ in calls)
    assert result["first_token_seconds"] == 0.030
    assert result["first_token_run_seconds"] == [0.050, 0.020, 0.030]
    assert result["seconds"] == 1.1 and result["tok_s"] == pytest.approx(5 / 1.1)
    assert result["decode_tok_s"] == pytest.approx(4 / (1.1 - 0.030))


def test_the_docs_say_how_each_run_timed_its_first_token():
    render = load_benchmark("render_docs")
    median = {"results": {"single": {"xla": {"first_token_run_seconds": [0.03, 0.02, 0.04]}}}}
    older = {"results": {"single": {"xla": {"first_token_seconds": 0.03}}}}
    assert render._first_token_runs(median, 3) == "(the first token: of 3 one-token requests)"
    assert render._first_token_runs(older, 3) == "(the first token: one one-token request)"
