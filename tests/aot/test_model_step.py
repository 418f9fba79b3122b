# SPDX-License-Identifier: Apache-2.0
"""The runner's whole step compiled by the real TPU and GPU compilers for real-size models.

For each case a worker (`model_step_worker`, one subprocess per platform, both at once) sizes
the KV cache of the model on one chip (`tpu_platform.plan_kv.fit_kv_cache`): it compiles the
prefill step (a 2k-token chunk) with a small cache, sizes the cache to what the chip's memory
has left, and compiles the prefill and decode (64 sequences) steps and the sampler (top-k/top-p)
again. A Mosaic or Triton compile error, or a program that no longer fits its chip, fails here.
Weights are abstract (`ShapeDtypeStruct`): nothing is allocated.

A small model is also planned with int8 weights beside its bfloat16 twin on a v5e chip: the
weights about halve and the cache takes what they free.

No one-chip TPU case has a mixture of experts: the smallest one the project runs,
Qwen3-30B-A3B, has 61 GB of bfloat16 weights, more than a v5e (16 GiB) or v6e (32 GiB) chip
holds; the planner's answer for it on v6e is checked instead.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker
from tpu_platform.plan import model_config

FITS = {
    "tpu": ["v5e-1:llama-3.2-3b", "v6e-1:llama-3.1-8b", "v6e-1:qwen3-8b", "v6e-1:gemma-2-9b"],
    "cuda": ["h100x1:llama-3.1-8b", "h100x1:qwen3-8b", "h100x1:gemma-2-9b", "h100x1:qwen3-30b-a3b"],
}
TOO_LARGE = {"tpu": ["v5e-1:llama-3.1-8b", "v6e-1:qwen3-30b-a3b"], "cuda": []}
# Published parameter counts (model cards): the abstract weights must be these, in bfloat16.
PARAMETERS = {
    "llama-3.2-3b": 3.21e9, "llama-3.1-8b": 8.03e9, "qwen3-8b": 8.19e9, "gemma-2-9b": 9.24e9,
    "qwen3-30b-a3b": 30.5e9,
}  # fmt: skip
BACKEND = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
# Planned with bfloat16 and with int8 weights (a model no other case plans: no compile repeated).
QUANTIZED = "v5e-1:qwen3-4b"


# Every case is a few compiles of a multi-billion-parameter program: minutes on a busy machine.
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    with ThreadPoolExecutor(2) as pool:
        cases = {p: FITS[p] + TOO_LARGE[p] for p in FITS}
        answers = pool.map(lambda p: run_worker(p, "model_step_worker", *cases[p], timeout=3500), cases)
        return {row["case"]: row for answer in answers for row in answer}


@pytest.fixture(scope="module")
def quantized_results() -> dict[str, dict]:
    answer = run_worker("tpu", "model_step_worker", QUANTIZED, f"{QUANTIZED}:int8", timeout=3500)
    return {row["case"]: row for row in answer}


def _platform(case: str) -> str:
    return "cuda" if case.startswith("h100") else "tpu"


@pytest.mark.parametrize("case", FITS["tpu"] + FITS["cuda"])
def test_step_compiles_and_fits_one_chip(results, case):
    row = results[case]
    assert row["fits"], row["reason"]
    assert row["backend"] == BACKEND[_platform(case)]
    model = case.split(":")[1]
    # A tied head is served from its own `[hidden, vocab]` copy (`models.prepare_for_serving`).
    config = model_config(model)
    head_copy = config.hidden_size * config.vocab_size if config.tie_word_embeddings else 0
    assert row["weight_bytes"] == pytest.approx(2 * (PARAMETERS[model] + head_copy), rel=0.01)
    assert row["kv_tokens"] >= MAX_MODEL_LEN  # at least one whole sequence
    for step in ("decode", "prefill"):
        program = row[step]
        # The compiled program takes the real-size weights and the sized cache...
        assert program["argument_bytes"] >= row["weight_bytes"] + row["kv_bytes"]
        # ... and all it needs at once fits the chip, within the planner's budget.
        assert program["peak_bytes"] <= row["budget_bytes"] <= row["hbm_bytes"]
        assert program["alias_bytes"] >= row["kv_bytes"]  # the donated caches are updated in place
    vocab_logits = row["sampler"]["argument_bytes"]
    assert vocab_logits >= 64 * 4 * 128_000  # the sampler's [64, V] float32 logits
    # The cache takes what the weights and the programs leave of the budget.
    peak = max(row["decode"]["peak_bytes"], row["prefill"]["peak_bytes"])
    assert row["budget_bytes"] - peak <= 0.05 * row["budget_bytes"]


@pytest.mark.parametrize("case", TOO_LARGE["tpu"] + TOO_LARGE["cuda"])
def test_planner_says_what_does_not_fit(results, case):
    row = results[case]
    assert not row["fits"] and row["compiles"] == 0
    over = row["weight_bytes"] - row["budget_bytes"]
    assert over > 0 and f"{over} B over" in row["reason"]


def test_int8_weights_halve_and_leave_the_cache_the_room(quantized_results):
    bf16, int8 = quantized_results[QUANTIZED], quantized_results[f"{QUANTIZED}:int8"]
    assert bf16["fits"] and int8["fits"], (bf16["reason"], int8["reason"])
    # int8 kernels and their float32 scales; the embedding table stays bfloat16.
    assert 0.45 * bf16["weight_bytes"] < int8["weight_bytes"] < 0.6 * bf16["weight_bytes"]
    for row in (bf16, int8):  # the compiled programs take the int8 weights beside the cache
        assert row["decode"]["argument_bytes"] >= row["weight_bytes"] + row["kv_bytes"]
        assert row["decode"]["peak_bytes"] <= row["budget_bytes"]
    # The bytes the weights free go to the cache (less what the steps' own buffers change).
    saved = bf16["weight_bytes"] - int8["weight_bytes"]
    assert int8["kv_tokens"] > bf16["kv_tokens"]
    assert int8["kv_bytes"] - bf16["kv_bytes"] >= 0.9 * saved
