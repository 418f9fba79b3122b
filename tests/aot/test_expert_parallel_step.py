# SPDX-License-Identifier: Apache-2.0
"""The runner's step under expert parallelism compiled by the real TPU and GPU compilers for
Qwen3-30B-A3B (128 experts of 768) split over 8 chips: v6e-8 and 8x H100.

The worker (`tensor_parallel_worker`, `:ep` cases) sizes the KV cache from the model's first 2
and 4 layers at full width (`tpu_platform.planner.depth`), the weights abstract and placed by the
rules table with the experts by index (`models.sharding`'s `expert_parallel=True`), the MoE
layers flagged as the runner flags them. Each chip holds 16 whole experts a layer (1/8 of the
experts' bytes), and the compiled steps exchange only what tensor parallelism does: the
`[tokens, hidden]` sums, the embedding's, the logits gathered once; no expert weight moves.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.aot.toolchains import run_worker

CASES = {"tpu": ["v6e-8:qwen3-30b-a3b:8:ep"], "cuda": ["h100x8:qwen3-30b-a3b:8:ep"]}

# A 30B mixture of experts at full width for two 8-chip targets: the costliest compile of the
# slow tier, so `make test-full` runs it (the expert placement and its collectives are checked at
# tiny size on simulated devices in `tests/models/test_expert_parallel.py`).
pytestmark = [pytest.mark.timeout(3600), pytest.mark.full]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    with ThreadPoolExecutor(2) as pool:
        answers = pool.map(
            lambda p: run_worker(p, "tensor_parallel_worker", "depth", *CASES[p], timeout=3500), CASES
        )
        return {row["case"]: row for answer in answers for row in answer}


@pytest.mark.parametrize("case", CASES["tpu"] + CASES["cuda"])
def test_each_chip_holds_an_eighth_of_the_experts_whole_and_the_step_fits(results, case):
    row = results[case]
    assert row["expert_parallel"] and row["fits"], row.get("reason")
    assert row["expert_bytes"] > 0.9 * row["total_weight_bytes"]  # 30B of the 30.5B are experts
    assert row["chip_expert_bytes"] * 8 == row["expert_bytes"]
    for step in ("decode", "prefill"):
        for program in row["short"][step]:
            assert program["alias_bytes"] > 0 and program["peak_bytes"] <= row["budget_bytes"]


@pytest.mark.parametrize("case", CASES["tpu"] + CASES["cuda"])
def test_the_decode_step_is_not_extrapolated_from_a_one_off_step_up(results, case):
    # On v6e-8 XLA keeps one layer's gathered expert tiles live from 3 layers on, not at 2: the
    # line through 2 and 4 layers alone put 3.98 GiB beside the weights and cache, where every
    # layer compiled keeps 0.43 GiB. The decode step's third depth keeps it under a GiB.
    row = results[case]
    assert row["step_depths"]["decode"] == [2, 4, 6]
    assert row["overhead_bytes"]["decode"] < 1 << 30


@pytest.mark.parametrize("case", CASES["tpu"] + CASES["cuda"])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_expert_parallel_step_exchanges_only_activation_sums(results, case, step):
    assert results[case]["unexpected_collectives"][step] == []
