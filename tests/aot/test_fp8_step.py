# SPDX-License-Identifier: Apache-2.0
"""The fp8 model step compiled by the real TPU and GPU compilers, weights abstract
(`int8_step_worker`): a decode step (64 sequences) of Llama 3.2 3B for a v5e chip beside its
bfloat16 twin, of Llama 3.1 8B with block scales (one per 128 inputs of each column) for a v6e
chip, and of Llama 3.1 8B for an H100. The program's arguments are the fp8 bytes plus the
scales (the bfloat16 head and embedding unchanged), and no weight-sized buffer of a wider type
appears in the optimized program: the fp8 -> bfloat16 convert is fused into the dots, never a
bfloat16 copy of a weight. (The TPU compiler moves some fp8 kernels in slices, as they are:
those buffers are fp8 and share memory, the temporaries staying below one kernel's bytes.)

The programs hold the models' first 2 layers at full width (a wider copy of a weight would be
made in each layer; the weights' bytes are checked for the whole models, the compiled programs'
arguments for the layers they hold); `make test-full` (`-m full`) compiles v6e's grouped case,
and every layer."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker
from tpu_platform.planner.abstract_weights import abstract_model
from tpu_platform.planner.plan import model_config

pytestmark = pytest.mark.timeout(3600)  # compiles of a multi-billion-parameter step

TPU_CASES = ("v5e-1:llama-3.2-3b:fp8", "v5e-1:llama-3.2-3b:bfloat16", "v6e-1:llama-3.1-8b:fp8-g128")
# v6e's grouped case is `make test-full`'s: v5e (no fp8 dots: the convert must stay inside the dot)
# keeps the TPU's fp8 path in `make test`, and the H100 case below fp8's own convert.
TPU_IN_FULL_ONLY = ("v6e-1:llama-3.1-8b:fp8-g128",)
GPU_CASES = ("h100x1:llama-3.1-8b:fp8",)
# Compiled layers: 2, and (`full`) every one, where the arguments are the whole model's bytes.
LAYERS = [pytest.param("2", id="2-layers"), pytest.param("0", marks=pytest.mark.full, id="every-layer")]


@pytest.fixture(scope="module", params=LAYERS)
def tpu_rows(request, case_rows):
    """The rows of the TPU cases a test names, compiled once a session at the layers' param (the
    2-layer bfloat16 twin is test_int8_step.py's too)."""
    return lambda *cases: case_rows.get("tpu", "int8_step_worker", (request.param,), cases)


@pytest.fixture(scope="module", params=LAYERS)
def gpu_results(request) -> dict[str, dict]:
    return {
        row["case"]: row
        for row in run_worker("cuda", "int8_step_worker", request.param, *GPU_CASES, timeout=3500)
    }


def _fp8_weight_bytes(model: str, group: int | None) -> int:
    """The served weights' bytes: the bfloat16 model's, less a byte a projection weight, plus a
    float32 scale per output channel (or per 128 inputs of each)."""
    config = model_config(model)
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_layers
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    kernels = layers * (hidden * qkv + config.num_heads * config.head_dim * hidden + 3 * hidden * inner)
    scales = kernels // group if group else layers * (qkv + hidden + 2 * inner + hidden)
    return abstract_model(config, "bfloat16", 2048).weight_bytes - kernels + 4 * scales


def _assert_fp8_program(row: dict, model: str, group: int | None) -> None:
    assert row["tokens"] == 64 and row["fp8_leaves"] > 0 and row["int8_leaves"] == 0
    assert row["weight_bytes"] == _fp8_weight_bytes(model, group)
    assert row["argument_bytes"] >= row["compiled_weight_bytes"]
    wider = [b for b in row["large_buffers"] if not b.split()[1].startswith("f8e4m3fn[")]
    assert wider == []


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=[pytest.mark.full] if c in TPU_IN_FULL_ONLY else [])
        for c in TPU_CASES
        if "fp8" in c
    ],
)
def test_tpu_fp8_step_holds_fp8_weights_without_a_wider_copy(tpu_rows, case):
    _, model, variant = case.split(":")
    rows = tpu_rows(case, TPU_CASES[1])  # with the bfloat16 twin the next test reads: one compile run
    _assert_fp8_program(rows[case], model, 128 if variant == "fp8-g128" else None)


def test_tpu_fp8_step_arguments_shrink_by_the_weights_saved(tpu_rows):
    rows = tpu_rows(*TPU_CASES[:2])
    fp8, bf16 = rows[TPU_CASES[0]], rows[TPU_CASES[1]]
    saved = bf16["weight_bytes"] - fp8["weight_bytes"]
    assert saved > 0.25 * bf16["weight_bytes"]  # the tied head's copy and the embedding stay bfloat16
    compiled_saved = bf16["compiled_weight_bytes"] - fp8["compiled_weight_bytes"]
    assert compiled_saved > 0
    assert bf16["argument_bytes"] - fp8["argument_bytes"] >= 0.99 * compiled_saved  # memory_analysis agrees
    assert fp8["temp_bytes"] <= bf16["temp_bytes"] * 1.05


def test_gpu_fp8_step_holds_fp8_weights_without_a_wider_copy(gpu_results):
    (case,) = GPU_CASES
    _assert_fp8_program(gpu_results[case], case.split(":")[1], None)
