# SPDX-License-Identifier: Apache-2.0
"""Qwen3-30B-A3B's step under expert parallelism at EP=8 on a v6e-8 (128 experts of 768, 16 whole
experts a chip), its first 2 layers at full width, by the real TPU compiler (`make test`'s
sibling of `test_expert_parallel_step.py`, which fits the whole model from 2 and 4 layers on
v6e-8 and 8x H100 in `make test-full`).

The worker (`expert_parallel_worker`) compiles a 64-sequence decode step (and in `make test-full`
a 2k-token prefill step, which takes about three times as long to compile). What each exchanges
is what the rules table implies and nothing else (per layer the `[tokens, hidden]` sums of
attention and of the experts, the embedding's, the logits gathered once): no all-to-all, since
every chip already holds every token and runs its own experts on the rows routed to them
(docs/architecture.md, "Expert parallelism on one host"); no buffer as large as one whole expert
stack of a layer (what gathering an expert weight would make); and the planner's arithmetic for
a chip's weights (`replicas.chip_weights`) is what the mesh places.

A 64-token decode reads each expert's kernels about once, with or without expert parallelism
(`models.moe_layout.every_token_pays`): the routed tiles' bound (about 320 tiles for 128
experts without it) gathered a copy of its expert's kernels per tile. The sibling without
expert parallelism (the same mesh, each expert split inside) is compiled in `make test-full`.
"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

CASE = "v6e-8:qwen3-30b-a3b:8:2"  # target:model:EP:layers
SPLIT_INSIDE = CASE + ":tp"  # the same chips, each expert split inside over them
STAGES = [pytest.param("decode", id="decode"), pytest.param("prefill", id="prefill", marks=pytest.mark.full)]
# Bytes a decode step's expert matmuls may move, per byte of the chip's experts: the kernels
# read once, plus the tokens' rows and the intermediate activations.
DECODE_EXPERT_READS = 1.5


@pytest.fixture(scope="module", params=STAGES)
def step(request) -> dict:
    return {"stage": request.param, **run_worker("tpu", "expert_parallel_worker", request.param, CASE)[0]}


def test_each_chip_holds_sixteen_whole_experts_a_layer_as_the_planner_counts(step):
    assert step["chip_expert_bytes"] == 2 * 16 * 3 * 2048 * 768 * 2  # 2 layers, bfloat16
    assert step["planned_weight_bytes"] == step["placed_weight_bytes"]
    assert step["smallest_expert_stack_bytes"] == 128 * 2048 * 768 * 2  # one whole [E, in, out] kernel


def test_the_step_exchanges_activation_sums_and_moves_no_expert_weight(step):
    program = step["steps"][step["stage"]]
    assert program["unexpected_collectives"] == []
    assert {c["kind"] for c in program["collectives"]} <= {"all-reduce", "all-gather"}
    assert program["expert_sized_buffers"] == []


def test_a_decode_step_reads_each_local_expert_about_once(step):
    # A 64-token decode's routed tiles would number ~48 a chip, most holding other chips'
    # assignments, each gathering its own copy of its expert's kernels (over 5x the chip's
    # experts, counting the chunk loop's body once); one tile of every token per local expert
    # reads each expert's kernels in place (`models.moe_layout`).
    if step["stage"] != "decode":
        pytest.skip("a prefill step keeps the routed tiles")
    assert step["steps"]["decode"]["expert_traffic_bytes"] <= DECODE_EXPERT_READS * step["chip_expert_bytes"]


@pytest.mark.full
def test_without_expert_parallelism_a_decode_step_reads_each_expert_about_once():
    # Each chip holds all 128 experts at an eighth of their width, the same bytes as 16 whole
    # ones; the routed bound's 320 tiles read over 6x those bytes.
    split = run_worker("tpu", "expert_parallel_worker", "decode", SPLIT_INSIDE)[0]
    assert split["chip_expert_bytes"] == 2 * 128 * 3 * 2048 * (768 // 8) * 2  # 2 layers, bfloat16
    assert split["steps"]["decode"]["unexpected_collectives"] == []
    assert (
        split["steps"]["decode"]["expert_traffic_bytes"] <= DECODE_EXPERT_READS * split["chip_expert_bytes"]
    )
