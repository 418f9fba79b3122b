# SPDX-License-Identifier: Apache-2.0
"""The runner's tensor-parallel step compiled by the real TPU and GPU compilers for real-size
models split over the chips of a target.

For each case a worker (`tensor_parallel_worker`, one subprocess per platform, both at once) sizes
the KV cache per chip on the runner's mesh (`StepSetup.tp_size`): in `make test` from the model's
first 2 and 4 layers at full width, the memory extrapolated to every layer
(`tpu_platform.planner.depth`; the collectives a layer makes show in each short program; on TPU the
prefill at 2 layers only, its memory bounded from above), in `make test-full` (`-m full`) with
every layer compiled (`tpu_platform.planner.kv.fit_kv_cache`): the weights abstract and placed by
the rules table (`models.sharding`), the caches split on KV heads (replicated in groups where the
model has fewer KV heads than chips), attention per chip under `shard_map` (Mosaic on TPU, Triton
on GPU). It compiles the prefill step (a 2k-token chunk) and the decode step (64 sequences) and the
sampler, and reads the compiled programs' collectives. A compile error, a sharding that makes the
compiler gather a whole weight or exchange anything the rules table does not imply, or a model that
does not fit its chips fails here. In `make test-full`, GPT-OSS-120B's short programs hold its real
shapes (128 experts, attention sinks, a sliding and a full layer in turn; on v6e-8 its prefill's
temporaries are checked in test_moe_step_temps.py), and Llama-4-Scout's hold three
chunked-attention layers and a NoPE one, each a mixture of 16 experts and a shared one (on 8x H100;
its chunked kernels compile for v6e in test_compile_kernels_tpu.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker

# `make test`: a dense model on a TPU slice, one KV head a chip (Llama-3.1-8B at TP=8: the
# 70B's rules, collectives and kernel at a narrower width, which the TPU compiler compiles
# sooner), and a mixture of experts split inside each expert on 8x H100 (its routed layers'
# rules, and the third depth a routed model's decode step compiles at).
CASES = {
    "tpu": ["v6e-8:llama-3.1-8b:8"],
    "cuda": ["h100x8:qwen3-30b-a3b:8"],
}
# The same paths on more chips, sizes and families (`make test-full`): the 70B on v6e-8 (its
# prefill at 2 and 4 layers), two KV heads a chip (TP=4 of 8 KV heads), v5e, the dense model on
# GPUs, and the families whose layers differ (GPT-OSS's sinks and sliding layers, Llama 4's
# chunked attention and shared expert: the rules table's same rules, their kernels compiled in
# test_compile_kernels_*.py, their placement on simulated devices in
# tests/plugin_shim/test_tensor_parallel.py).
MORE_CASES = {
    "tpu": ["v6e-8:llama-3.1-70b:8", "v5e-4:llama-3.1-8b:4", "v6e-4:llama-3.1-8b:4"],
    "cuda": ["h100x8:llama-3.1-70b:8", "h100x8:gpt-oss-120b:8", "h100x8:llama-4-scout:8"],
}
ALL_CASES = {p: CASES[p] + MORE_CASES[p] for p in CASES}
# `make test`'s worker mode a platform: on TPU the prefill at 2 layers only, its memory bounded
# from above (a TPU prefill program compiles for minutes at any depth; its every layer is
# `make test-full`'s, below).
DEPTH_MODES = {"tpu": "depth-one-prefill", "cuda": "depth"}
MOE_SHAPES = ("gpt-oss", "llama-4")  # sinks, sliding, chunked layers and shared experts
MOE_CASES = [c for c in ALL_CASES["tpu"] + ALL_CASES["cuda"] if c.split(":")[1].startswith(MOE_SHAPES)]
# Published parameter counts (model cards): the abstract weights must be these, in bfloat16
# (but the mxfp4 experts).
PARAMETERS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.55e9,
    "qwen3-30b-a3b": 30.5e9,
    "gpt-oss-120b": 116.83e9,
    # Llama-4-Scout's text model, 107.77e9 of its 109e9 (the rest is the vision encoder).
    "llama-4-scout": 107.77e9,
}
# Expert kernel parameters a checkpoint ships in mxfp4 (GPT-OSS as released), 17 bytes per 32,
# and as served at TP=8: F padded from 90 to 96 blocks of 32, whole blocks a chip.
MXFP4_EXPERTS = {"gpt-oss-120b": (36 * 128 * 3 * 2880 * 2880, 36 * 128 * 3 * 2880 * 3072)}
BACKEND = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}

# Every case is a few compiles of a multi-billion-parameter sharded program: minutes.
pytestmark = pytest.mark.timeout(3600)


def _run(modes: dict[str, str], cases: dict[str, list[str]]) -> dict[str, dict]:
    with ThreadPoolExecutor(2) as pool:
        answers = pool.map(
            lambda p: run_worker(p, "tensor_parallel_worker", modes[p], *cases[p], timeout=3500), cases
        )
        return {row["case"]: row for answer in answers for row in answer}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return _run(DEPTH_MODES, CASES)


@pytest.fixture(scope="module")
def more_results() -> dict[str, dict]:
    return _run(dict.fromkeys(MORE_CASES, "depth"), MORE_CASES)


@pytest.fixture(scope="module")
def full_results() -> dict[str, dict]:
    return _run(dict.fromkeys(ALL_CASES, "full"), ALL_CASES)


def _depth_results(request: pytest.FixtureRequest, case: str) -> dict:
    in_make_test = case in CASES["tpu"] + CASES["cuda"]
    return request.getfixturevalue("results" if in_make_test else "more_results")[case]


DEPTH_CASES = (
    CASES["tpu"]
    + CASES["cuda"]
    + [pytest.param(case, marks=pytest.mark.full) for case in MORE_CASES["tpu"] + MORE_CASES["cuda"]]
)


def _check_weights(row: dict, case: str) -> None:
    assert row["fits"], row["reason"]
    assert row["backend"] == BACKEND["cuda" if case.startswith("h100") else "tpu"]
    model, tp = case.split(":")[1], row["tp_size"]
    total = row["total_weight_bytes"]
    shipped, served = MXFP4_EXPERTS.get(model, (0, 0))
    assert total == pytest.approx(2 * (PARAMETERS[model] - shipped) + served * 17 / 32, rel=0.01)
    # Each chip holds 1/N of every split weight and all of the few replicated ones (norms, the
    # router, the RoPE table).
    assert row["replicated_weight_bytes"] <= 0.005 * total
    assert total / tp <= row["weight_bytes"] <= total / tp + row["replicated_weight_bytes"]
    assert row["kv_tokens"] >= MAX_MODEL_LEN  # at least one whole sequence per chip's cache


@pytest.mark.parametrize("case", DEPTH_CASES)
def test_sharded_step_at_two_depths_fits_each_chip(request, case):
    row = _depth_results(request, case)
    _check_weights(row, case)
    for step in ("decode", "prefill"):
        for program in row["short"][step]:  # the chip's shards in, the donated cache in place
            assert program["alias_bytes"] > 0 and program["peak_bytes"] <= row["budget_bytes"]
        assert row["predicted_peak_bytes"][step] <= row["steps_budget_bytes"] <= row["budget_bytes"]


@pytest.mark.parametrize("case", DEPTH_CASES)
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_sharded_step_at_two_depths_exchanges_what_the_rules_table_implies(request, case, step):
    # As below, for each short program's own number of layers.
    assert _depth_results(request, case)["unexpected_collectives"][step] == []


@pytest.mark.full
@pytest.mark.parametrize("case", ALL_CASES["tpu"] + ALL_CASES["cuda"])
def test_sharded_step_compiles_and_fits_each_chip(full_results, case):
    row = full_results[case]
    _check_weights(row, case)
    for step in ("decode", "prefill"):
        program = row[step]
        # The compiler's own per-chip view: the arguments are the chip's weight shards and its
        # cache shard (plus the step's small inputs), not whole weights...
        chip_state = row["weight_bytes"] + row["kv_bytes"]
        assert chip_state <= program["argument_bytes"] <= chip_state + (64 << 20)
        # ... all it needs at once fits the chip, within the planner's budget...
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]  # the donated caches updated in place
    # The cache takes what the weights and the programs leave of the budget.
    peak = max(row["decode"]["peak_bytes"], row["prefill"]["peak_bytes"])
    assert row["budget_bytes"] - peak <= 0.05 * row["budget_bytes"]


@pytest.mark.full
@pytest.mark.parametrize("case", ALL_CASES["tpu"] + ALL_CASES["cuda"])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_sharded_step_exchanges_what_the_rules_table_implies(full_results, case, step):
    # Per layer the two row-parallel sums of [tokens, hidden], the embedding's sum and the
    # [rows, vocab] logits gathered once; no weight gathered whole, nothing else.
    assert full_results[case]["unexpected_collectives"][step] == []


@pytest.mark.full
@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_moe_step_holds_no_cache_sized_temporaries(full_results, case, step):
    # GPT-OSS's sinks, fused experts and sliding layers, Llama 4's chunked layers and shared
    # expert add no copy of the cache to the step. Only with every layer: a short program's cache
    # is a few layers' share, smaller than the prefill's own activations.
    row = full_results[case]
    assert row[step]["temp_bytes"] < row["kv_bytes"] // 8, (row[step]["temp_bytes"], row["kv_bytes"])
