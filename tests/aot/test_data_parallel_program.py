# SPDX-License-Identifier: Apache-2.0
"""Data parallelism on a v6e-8 (`--data-parallel-size 8`, one chip a replica) compiles no program of
its own: each replica is its own engine process seeing only its chip, which builds the runner's
one-chip step, the program a v6e-1 serves, and the planner's replica rows
(`tpu_platform.planner.replicas`) are that program's.

The worker (`data_parallel_worker`) compiles Llama-3.1-8B's step, its first 2 layers at full
width (the step's shape per layer is the whole model's), with the planner's `step_program` (the
runner's own builder) for a chip of the v6e-8 and for a v6e-1: the optimized programs are the
same text, with the same memory, on one partition with no collective. Only `make test-full` runs
it (the decode step for the last chip, then the decode and prefill steps for the first and the
last; each compile takes tens of seconds on two cores): the one-chip step it proves every replica
serves is compiled for v6e-1 in `make test` (`test_model_step.py`), and the replica arithmetic is
checked by hand-worked cases in `tests/tpu_platform/test_plan_replicas.py`.
"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

ONE_CHIP = "v6e-1:llama-3.1-8b:2:0"
CASES = [
    pytest.param(("decode", ["v6e-8:llama-3.1-8b:2:7"]), id="decode-chip-7", marks=pytest.mark.full),
    pytest.param(
        ("decode,prefill", ["v6e-8:llama-3.1-8b:2:0", "v6e-8:llama-3.1-8b:2:7"]),
        id="both-steps-chips-0-and-7",
        marks=pytest.mark.full,
    ),
]


@pytest.fixture(scope="module", params=CASES)
def replicas(request) -> tuple[list[str], list[str], dict[str, dict]]:
    steps, chips = request.param
    rows = run_worker("tpu", "data_parallel_worker", steps, *chips, ONE_CHIP)
    return steps.split(","), chips, {row["case"]: row for row in rows}


def test_every_replica_compiles_the_one_chip_program(replicas):
    steps, chips, compiled = replicas
    assert {compiled[case]["device_id"] for case in chips} == {int(case[-1]) for case in chips}
    for step in steps:
        one_chip = compiled[ONE_CHIP]["steps"][step]
        assert (one_chip["num_partitions"], one_chip["collectives"]) == (1, 0)
        for case in chips:
            program = compiled[case]["steps"][step]
            assert program["hlo"] == one_chip["hlo"], (case, step)
            assert program["memory"] == one_chip["memory"], (case, step)
