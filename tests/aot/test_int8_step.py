# SPDX-License-Identifier: Apache-2.0
"""The int8 model step compiled by the real TPU compiler beside its bfloat16 twin, weights
abstract (`int8_step_worker`): decode (64 sequences) and a prefill chunk (one sequence, 512
tokens) for a v5e chip. The weights' bytes are about halved (the embedding table stays
bfloat16), the program's arguments shrink by as much, and no weight-sized buffer appears in the
optimized program (the int8 -> bfloat16 convert is fused into the dots, not a copy of the
weights), for the many-token dots of a prefill as for decode's. With scales per group of 32
inputs (a GGUF's Q8_0 layout) the weights' bytes are int8 plus a float32 scale per 32 weights,
and the per-group partial products are fused into their dots alike (no weight-sized buffer).

The programs hold the model's first 2 layers at full width (a copy of a weight would be made in
each layer; the weights' bytes are checked for the whole model, the compiled programs' bytes for
the layers they hold), all of them compiled by one worker. `make test-full` (`-m full`) compiles
the prefill chunk, and every layer of the decode step for a v5e and a v6e chip."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

TARGET, MODEL = "v5e-1", "llama-3.2-3b"
DECODE_CASES = [f"{TARGET}:{MODEL}:{variant}" for variant in ("bfloat16", "int8", "int8-g32")]
PREFILL_CASES = [f"{TARGET}:{MODEL}:{variant}:prefill" for variant in ("bfloat16", "int8")]
LAYERS = 2  # compiled layers
# Every layer compiled (`full`): the decode step on one chip of each TPU generation served.
EVERY_LAYER_CASES = {"v5e-1": "llama-3.2-3b", "v6e-1": "llama-3.1-8b"}

pytestmark = pytest.mark.timeout(3600)  # compiles of a multi-billion-parameter step


def _run(num_layers: int, cases: list[str]) -> dict[str, dict]:
    rows = run_worker("tpu", "int8_step_worker", str(num_layers), *cases, timeout=3500)
    return {row["case"]: row for row in rows}


@pytest.fixture(scope="module")
def results(case_rows) -> dict[str, dict]:
    # The bfloat16 decode twin is test_fp8_step.py's too: compiled once a session.
    return case_rows.get("tpu", "int8_step_worker", (str(LAYERS),), DECODE_CASES)


@pytest.fixture(scope="module")
def prefill_results(case_rows) -> dict[str, dict]:
    return case_rows.get("tpu", "int8_step_worker", (str(LAYERS),), PREFILL_CASES)


@pytest.fixture(scope="module")
def every_layer_results() -> dict[str, dict]:
    return _run(0, [f"{t}:{m}:{v}" for t, m in EVERY_LAYER_CASES.items() for v in ("bfloat16", "int8")])


def test_grouped_int8_step_compiles_without_a_weight_sized_buffer(results):
    bf16_case, _, grouped_case = DECODE_CASES
    bf16, grouped = results[bf16_case], results[grouped_case]
    assert grouped["int8_leaves"] > 0 and bf16["int8_leaves"] == 0
    # 1 + 4/32 bytes a weight against 2 (the bfloat16 embedding table unchanged)
    assert grouped["weight_bytes"] < 0.65 * bf16["weight_bytes"]
    saved = bf16["compiled_weight_bytes"] - grouped["compiled_weight_bytes"]
    assert bf16["argument_bytes"] - grouped["argument_bytes"] >= 0.99 * saved
    assert grouped["large_buffers"] == []


def test_int8_step_compiles_with_weight_bytes_halved(results):
    bf16, int8 = results[DECODE_CASES[0]], results[DECODE_CASES[1]]
    assert bf16["tokens"] == int8["tokens"] == 64
    _assert_weight_bytes_halved(bf16, int8)


# `full`: two TPU programs of minutes each; the decode step above checks the int8 convert fused
# into its dots on v5e, and a prefill's temporaries per layer are checked on 8x H100
# (test_moe_step_temps.py).
@pytest.mark.full
def test_int8_prefill_compiles_with_weight_bytes_halved(prefill_results):
    bf16, int8 = (prefill_results[case] for case in PREFILL_CASES)
    assert bf16["tokens"] == int8["tokens"] == 512
    _assert_weight_bytes_halved(bf16, int8)


@pytest.mark.full
@pytest.mark.parametrize("target", sorted(EVERY_LAYER_CASES))
def test_every_layer_int8_step_compiles_with_weight_bytes_halved(every_layer_results, target):
    bf16 = every_layer_results[f"{target}:{EVERY_LAYER_CASES[target]}:bfloat16"]
    int8 = every_layer_results[f"{target}:{EVERY_LAYER_CASES[target]}:int8"]
    assert bf16["tokens"] == int8["tokens"] == 64
    _assert_weight_bytes_halved(bf16, int8)


def _assert_weight_bytes_halved(bf16: dict, int8: dict) -> None:
    assert int8["int8_leaves"] > 0 and bf16["int8_leaves"] == 0
    assert int8["weight_bytes"] < 0.6 * bf16["weight_bytes"]
    saved = bf16["compiled_weight_bytes"] - int8["compiled_weight_bytes"]
    assert bf16["argument_bytes"] - int8["argument_bytes"] >= 0.99 * saved  # memory_analysis agrees
    # The peak drops by (nearly) what the weights save: no temporary takes it back.
    assert bf16["peak_bytes"] - int8["peak_bytes"] >= 0.9 * saved
    assert int8["large_buffers"] == []
