# SPDX-License-Identifier: Apache-2.0
"""The runner's whole step compiled by the real TPU and GPU compilers for real-size models.

For each case a worker (`model_step_worker`, one subprocess per platform, both at once) sizes
the KV cache of the model on one chip. In `make test` the step is compiled with the model's
first 2 and 4 layers at full width and its memory extrapolated to every layer
(`tpu_platform.planner.depth.fit_by_depth`: weights and KV per layer are exact arithmetic, what the
steps need beyond them is extrapolated from the two depths); on TPU the 2k-token prefill at 2
layers only, its memory bounded from above (a TPU prefill compiles for minutes at any depth; its
two depths are `make test-full`'s). One model a target family (Llama-3.1-8B on v6e-1 and on an
H100) is then compiled with every layer at the cache size the extrapolation gave, and must fit
as predicted: both steps on the H100, the decode step on v6e-1 (its whole prefill: `make
test-full`'s). `make test-full` (`-m full`) sizes every case
with every layer compiled (`tpu_platform.planner.kv.fit_kv_cache`, the planner's own answer).
A Mosaic or Triton compile error, or a program that no longer fits its chip, fails here.
Weights are abstract (`ShapeDtypeStruct`): nothing is allocated.

In `make test-full` a small model is also planned with int8 weights beside its bfloat16 twin on
a v5e chip: the weights about halve and the cache takes what they free (`make test` checks the
planner's int8 weights against the runner's, `tests/tpu_platform/test_plan.py`, and the compiled
int8 step's peak dropping by what they save, `test_int8_step.py`; the cache taking what the
steps leave is checked here for every case).

`make test` compiles Llama on v6e and H100 (one model a target family; the other families'
kernels compile for both in test_compile_kernels_*.py); `make test-full` repeats the path on
more models and chips (Llama-3.2-3B on v5e, Qwen3-8B on v6e and H100, Gemma 2 on v6e and H100,
Qwen3's mixture of experts on H100). All of a run's cases of one platform
go to one worker process a mode, the TPU's and the GPU's side by side.

No one-chip TPU case has a mixture of experts: the smallest one the project runs,
Qwen3-30B-A3B, has 61 GB of bfloat16 weights, more than a v5e (16 GiB) or v6e (32 GiB) chip
holds; the planner's answer for it on v6e is checked instead.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN, WHOLE_STEPS
from tests.aot.toolchains import run_worker
from tpu_platform.planner.depth import step_depths
from tpu_platform.planner.plan import model_config

FITS = {
    "tpu": ["v6e-1:llama-3.1-8b"],
    "cuda": ["h100x1:llama-3.1-8b"],
}
# The same path on more models and chips: `make test-full`. Each repeats a class of check `make
# test` makes on Llama: Gemma 2's windowed, capped kernels compile for v5e and H100 in
# test_compile_kernels_*.py; Qwen3's routed experts (and their third depth) at TP=8 on 8x H100 in
# test_tensor_parallel_step.py.
MORE_FITS = {
    "tpu": ["v5e-1:llama-3.2-3b", "v6e-1:qwen3-8b", "v6e-1:gemma-2-9b"],
    "cuda": ["h100x1:qwen3-8b", "h100x1:gemma-2-9b", "h100x1:qwen3-30b-a3b"],
}
TOO_LARGE = {"tpu": ["v5e-1:llama-3.1-8b", "v6e-1:qwen3-30b-a3b"], "cuda": []}
# `make test`'s worker mode a platform: on TPU the prefill at 2 layers only (bounded from above).
DEPTH_MODES = {"tpu": "depth-one-prefill", "cuda": "depth"}
# Compiled with every layer as well, at the extrapolated cache size: one model a target family,
# the worker's mode saying which steps. The whole prefill on v6e-1 is `make test-full`'s.
WHOLE_DEPTH = {"v6e-1:llama-3.1-8b": "depth-one-prefill+full-decode", "h100x1:llama-3.1-8b": "depth+full"}
# Published parameter counts (model cards): the abstract weights must be these, in bfloat16.
PARAMETERS = {
    "llama-3.2-3b": 3.21e9, "llama-3.1-8b": 8.03e9, "qwen3-8b": 8.19e9, "gemma-2-9b": 9.24e9,
    "qwen3-30b-a3b": 30.5e9,
}  # fmt: skip
BACKEND = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
# Planned with bfloat16 and with int8 weights (a model no other case plans), in `make test-full`.
QUANTIZED = "v5e-1:qwen3-4b"
# How far the whole model's compiled peak may be from the extrapolation's, of the chip's budget.
EXTRAPOLATION_TOLERANCE = 0.03


# Every case is a few compiles of a multi-billion-parameter program: minutes on a busy machine.
pytestmark = pytest.mark.timeout(3600)


def _run(mode_of, cases: dict[str, list[str]]) -> dict[str, dict]:
    def one(platform: str) -> list[dict]:
        rows = []
        for mode in dict.fromkeys(mode_of(case) for case in cases[platform]):
            chosen = [case for case in cases[platform] if mode_of(case) == mode]
            rows += run_worker(platform, "model_step_worker", mode, *chosen, timeout=3500)
        return rows

    with ThreadPoolExecutor(2) as pool:
        return {row["case"]: row for rows in pool.map(one, cases) for row in rows}


def _depth_mode(case: str) -> str:
    return WHOLE_DEPTH.get(case, DEPTH_MODES[_platform(case)])


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return _run(_depth_mode, {p: FITS[p] + TOO_LARGE[p] for p in FITS})


@pytest.fixture(scope="module")
def more_results() -> dict[str, dict]:
    # Both depths of every step, the TPU's prefill too; the quantized pair beside the TPU's cases.
    cases = {p: list(MORE_FITS[p]) for p in MORE_FITS}
    cases["tpu"] += [QUANTIZED, f"{QUANTIZED}:int8"]
    return _run(lambda case: "depth", cases)


@pytest.fixture(scope="module")
def whole_results() -> dict[str, dict]:
    """The `WHOLE_DEPTH` cases with both steps compiled whole, where `make test` leaves one out."""
    partial = [case for case, mode in WHOLE_DEPTH.items() if mode != "depth+full"]
    return _run(lambda case: "depth+full", {p: [c for c in partial if _platform(c) == p] for p in FITS})


@pytest.fixture(scope="module")
def full_results() -> dict[str, dict]:
    return _run(lambda case: "full", {p: FITS[p] + MORE_FITS[p] + TOO_LARGE[p] for p in FITS})


def _more(cases: list[str]) -> list:
    return [pytest.param(case, marks=pytest.mark.full) for case in cases]


def _platform(case: str) -> str:
    return "cuda" if case.startswith("h100") else "tpu"


def _check_weights(row: dict, case: str) -> None:
    assert row["backend"] == BACKEND[_platform(case)]
    model = case.split(":")[1]
    # A tied head is served from its own `[hidden, vocab]` copy (`models.prepare_for_serving`).
    config = model_config(model)
    head_copy = config.hidden_size * config.vocab_size if config.tie_word_embeddings else 0
    assert row["weight_bytes"] == pytest.approx(2 * (PARAMETERS[model] + head_copy), rel=0.01)
    assert row["kv_tokens"] >= MAX_MODEL_LEN  # at least one whole sequence


def _check_program(program: dict, weight_bytes: int, kv_bytes: int) -> None:
    # The compiled program takes the weights and the cache, and updates the donated cache in place.
    assert program["argument_bytes"] >= weight_bytes + kv_bytes
    assert program["alias_bytes"] >= kv_bytes


@pytest.mark.parametrize("case", FITS["tpu"] + FITS["cuda"] + _more(MORE_FITS["tpu"] + MORE_FITS["cuda"]))
def test_step_compiles_at_two_depths_and_fits_one_chip(request, case):
    row = request.getfixturevalue("results" if case in FITS[_platform(case)] else "more_results")[case]
    assert row["fits"], row["reason"]
    _check_weights(row, case)
    # A routed-experts model's decode step also compiles at a third depth (`step_depths`).
    decode_depths = step_depths(
        (2, 4), "decode", routed_experts=model_config(case.split(":")[1]).num_experts > 0
    )
    assert row["depths"] == [2, 4] and row["step_depths"]["decode"] == list(decode_depths)
    assert len(row["short"]["decode"]) == len(decode_depths)
    for step in ("decode", "prefill"):
        for program in row["short"][step]:
            assert program["alias_bytes"] > 0 and program["peak_bytes"] <= row["budget_bytes"]
        # The whole model's step, extrapolated, fits the budget the sampler leaves...
        assert row["predicted_peak_bytes"][step] <= row["steps_budget_bytes"] <= row["budget_bytes"]
    # ... and the cache takes what the weights and the steps leave of it.
    peak = max(row["predicted_peak_bytes"].values())
    assert row["steps_budget_bytes"] - peak <= row["page_bytes"]
    assert row["sampler"]["argument_bytes"] >= 64 * 4 * 128_000  # the sampler's [64, V] float32 logits


def _in_make_test(case: str, step: str) -> bool:
    return step in WHOLE_STEPS[WHOLE_DEPTH[case]]


@pytest.mark.parametrize(
    ("case", "step"),
    [
        pytest.param(case, step, marks=[] if _in_make_test(case, step) else [pytest.mark.full])
        for case in WHOLE_DEPTH
        for step in ("decode", "prefill")
    ],
)
def test_every_layer_compiled_fits_as_extrapolated(request, case, step):
    row = request.getfixturevalue("results" if _in_make_test(case, step) else "whole_results")[case]
    program = row[f"full_{step}"]
    _check_program(program, row["weight_bytes"], row["kv_bytes"])
    assert program["peak_bytes"] <= row["budget_bytes"]
    off = abs(program["peak_bytes"] - row["predicted_peak_bytes"][step])
    assert off <= EXTRAPOLATION_TOLERANCE * row["budget_bytes"], (step, program, row["overhead_bytes"])


@pytest.mark.full
@pytest.mark.parametrize("case", FITS["tpu"] + FITS["cuda"] + MORE_FITS["tpu"] + MORE_FITS["cuda"])
def test_step_compiled_with_every_layer_fits_one_chip(full_results, case):
    row = full_results[case]
    assert row["fits"], row["reason"]
    _check_weights(row, case)
    for step in ("decode", "prefill"):
        program = row[step]
        _check_program(program, row["weight_bytes"], row["kv_bytes"])
        # ... and all it needs at once fits the chip, within the planner's budget.
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
    assert row["sampler"]["argument_bytes"] >= 64 * 4 * 128_000  # the sampler's [64, V] float32 logits
    # The cache takes what the weights and the programs leave of the budget.
    peak = max(row["decode"]["peak_bytes"], row["prefill"]["peak_bytes"])
    assert row["budget_bytes"] - peak <= 0.05 * row["budget_bytes"]


@pytest.mark.parametrize("case", TOO_LARGE["tpu"] + TOO_LARGE["cuda"])
def test_planner_says_what_does_not_fit(results, case):
    row = results[case]
    assert not row["fits"] and row["short"] == {}
    over = row["weight_bytes"] - row["budget_bytes"]
    assert over > 0 and f"{over} B over" in row["reason"]


@pytest.mark.full
def test_int8_weights_halve_and_leave_the_cache_the_room(more_results):
    bf16, int8 = more_results[QUANTIZED], more_results[f"{QUANTIZED}:int8"]
    assert bf16["fits"] and int8["fits"], (bf16["reason"], int8["reason"])
    # int8 kernels and their float32 scales; the embedding table stays bfloat16.
    assert 0.45 * bf16["weight_bytes"] < int8["weight_bytes"] < 0.6 * bf16["weight_bytes"]
    for row in (bf16, int8):  # the compiled programs take the int8 weights beside the cache
        for program in row["short"]["decode"]:
            assert program["alias_bytes"] > 0
        assert row["predicted_peak_bytes"]["decode"] <= row["budget_bytes"]
    # The bytes the weights free go to the cache, less what the steps' own buffers change: from
    # two short depths those are extrapolated layer by layer, and an int8 layer's working memory
    # (its dots' dequantized tiles) is counted once a layer, where the whole program reuses it.
    saved = bf16["weight_bytes"] - int8["weight_bytes"]
    assert int8["kv_tokens"] > bf16["kv_tokens"]
    assert int8["kv_bytes"] - bf16["kv_bytes"] >= 0.7 * saved
