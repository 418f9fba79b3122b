# SPDX-License-Identifier: Apache-2.0
"""The runner's tensor-parallel step compiled by the real TPU and GPU compilers for real-size
models split over the chips of a target.

For each case a worker (`tensor_parallel_worker`, one subprocess per platform, both at once)
sizes the KV cache per chip on the runner's mesh (`tpu_platform.plan_kv.fit_kv_cache` with
`StepSetup.tp_size`): the weights abstract and placed by the rules table (`models.sharding`),
the caches split on KV heads (replicated in groups where the model has fewer KV heads than
chips), attention per chip under `shard_map` (Mosaic on TPU, Triton on GPU). It compiles the
prefill step (a 2k-token chunk) and the decode step (64 sequences) and the sampler, and reads
the compiled programs' collectives. A compile error, a sharding that makes the compiler gather
a whole weight or exchange anything the rules table does not imply, or a model that does not
fit its chips fails here. GPT-OSS-120B runs with its first 4 layers (`MODEL:TP:LAYERS`): its
real shapes (128 experts, attention sinks, a sliding and a full layer in turn) in a fraction of
the compile time. Not on v6e-8 yet: there its sharded steps' memory grows faster than the KV
cache, so no cache size fits (docs/kernels.md). Llama-4-Scout runs with its first 4 layers too:
three chunked-attention layers and a NoPE one, each a mixture of 16 experts and a shared one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.aot.model_step_worker import MAX_MODEL_LEN
from tests.aot.toolchains import run_worker

CASES = {
    "tpu": [
        "v5e-4:llama-3.1-8b:4",
        "v6e-4:llama-3.1-8b:4",
        "v6e-8:llama-3.1-70b:8",
        "v6e-8:llama-4-scout:8:4",
    ],
    "cuda": [
        "h100x8:llama-3.1-70b:8",
        "h100x8:qwen3-30b-a3b:8",
        "h100x8:gpt-oss-120b:8:4",
        "h100x8:llama-4-scout:8:4",
    ],
}
# Published parameter counts (model cards): the abstract weights must be these, in bfloat16.
# GPT-OSS-120B's 116.83e9 are 36 layers of 3.2131e9 and 1.1583e9 of embedding and head.
PARAMETERS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.55e9,
    "qwen3-30b-a3b": 30.5e9,
    "gpt-oss-120b:4": 116.83e9 - 32 * 3.2131e9,
    # Llama-4-Scout's text model, 107.77e9 of its 109e9 (the rest is the vision encoder): 48
    # layers of 2.2021e9 (16 experts and a shared one of 3 x 5120 x 8192 each, attention 62.9e6)
    # and 2.069e9 of embedding and head.
    "llama-4-scout:4": 107.77e9 - 44 * 2.2021e9,
}
BACKEND = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}

# Every case is a few compiles of a multi-billion-parameter sharded program: minutes.
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    with ThreadPoolExecutor(2) as pool:
        answers = pool.map(lambda p: run_worker(p, "tensor_parallel_worker", *CASES[p], timeout=3500), CASES)
        return {row["case"]: row for answer in answers for row in answer}


@pytest.mark.parametrize("case", CASES["tpu"] + CASES["cuda"])
def test_sharded_step_compiles_and_fits_each_chip(results, case):
    row = results[case]
    assert row["fits"], row["reason"]
    assert row["backend"] == BACKEND["cuda" if case.startswith("h100") else "tpu"]
    model, tp = ":".join(case.split(":")[1::2]), row["tp_size"]  # name[:layers]
    total = row["total_weight_bytes"]
    assert total == pytest.approx(2 * PARAMETERS[model], rel=0.01)
    # Each chip holds 1/N of every split weight and all of the few replicated ones (norms, the
    # router, the RoPE table).
    assert row["replicated_weight_bytes"] <= 0.005 * total
    assert total / tp <= row["weight_bytes"] <= total / tp + row["replicated_weight_bytes"]
    assert row["kv_tokens"] >= MAX_MODEL_LEN  # at least one whole sequence per chip's cache
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


@pytest.mark.parametrize("case", CASES["tpu"] + CASES["cuda"])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_sharded_step_exchanges_what_the_rules_table_implies(results, case, step):
    # Per layer the two row-parallel sums of [tokens, hidden], the embedding's sum and the
    # [rows, vocab] logits gathered once; no weight gathered whole, nothing else.
    assert results[case]["unexpected_collectives"][step] == []


@pytest.mark.parametrize(
    "case", [c for c in CASES["tpu"] + CASES["cuda"] if "gpt-oss" in c or "llama-4" in c]
)
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_moe_step_holds_no_cache_sized_temporaries(results, case, step):
    # GPT-OSS's sinks, fused experts and sliding layers, Llama 4's chunked layers and shared
    # expert add no copy of the cache to the step.
    row = results[case]
    assert row[step]["temp_bytes"] < row["kv_bytes"] // 8, (row[step]["temp_bytes"], row["kv_bytes"])
