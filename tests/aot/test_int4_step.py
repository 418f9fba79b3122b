# SPDX-License-Identifier: Apache-2.0
"""The int4 model step compiled by the real TPU and GPU compilers, weights abstract
(`int8_step_worker`): a decode step (64 sequences) of Llama 3.1 8B's first two layers at full
width with a 4-bit checkpoint's weights, one scale per 128 inputs of each column (GPTQ and
compressed-tensors W4A16 as usually shipped) and per channel, for a v6e chip; per channel for an
H100. The program's arguments are the int4 values two a byte plus the float32 scales (the
bfloat16 head and embedding unchanged), and no weight-sized buffer of a wider type (a bfloat16
or int8 copy of a weight) appears in the optimized program: the int4 -> bfloat16 convert is
fused into the dots. (On GPU a grouped int4 kernel is dequantized or multiplied per group:
`models.int8.int8_dot_on_gpu`; not asserted here.)"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker
from tpu_platform.planner.abstract_weights import abstract_model
from tpu_platform.planner.plan import first_layers, model_config

TPU_CASES = ("v6e-1:llama-3.1-8b:int4-g128", "v6e-1:llama-3.1-8b:int4")
# Per channel on v6e is `make test-full`'s: `make test` compiles it on the H100 and the grouped
# layout (its scales a superset of the per-channel broadcast) on v6e, where XLA's packed int4
# type is the TPU's own path (int8's v5e steps do not take it).
TPU_IN_FULL_ONLY = ("v6e-1:llama-3.1-8b:int4",)
GPU_CASES = ("h100x1:llama-3.1-8b:int4",)
LAYERS = "2"  # a bfloat16 copy of a weight would be made in each layer


def _tpu_rows(cases: list[str]) -> dict[str, dict]:
    return {row["case"]: row for row in run_worker("tpu", "int8_step_worker", LAYERS, *cases, timeout=3500)}


@pytest.fixture(scope="module")
def tpu_results() -> dict[str, dict]:
    return _tpu_rows([case for case in TPU_CASES if case not in TPU_IN_FULL_ONLY])


@pytest.fixture(scope="module")
def tpu_full_results() -> dict[str, dict]:
    return _tpu_rows(list(TPU_IN_FULL_ONLY))


@pytest.fixture(scope="module")
def gpu_results() -> dict[str, dict]:
    return {
        row["case"]: row for row in run_worker("cuda", "int8_step_worker", LAYERS, *GPU_CASES, timeout=3500)
    }


def _int4_weight_bytes(group: int | None) -> int:
    """The two layers' served bytes: the bfloat16 model's, with half a byte instead of two a
    projection weight, plus a float32 scale per output channel (or per 128 inputs of each)."""
    config = first_layers(model_config("llama-3.1-8b"), int(LAYERS))
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_layers
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    kernels = layers * (hidden * qkv + config.num_heads * config.head_dim * hidden + 3 * hidden * inner)
    scales = kernels // group if group else layers * (qkv + hidden + 2 * inner + hidden)
    return abstract_model(config, "bfloat16", 2048).weight_bytes - 2 * kernels + kernels // 2 + 4 * scales


def _assert_int4_program(row: dict, group: int | None) -> None:
    assert row["tokens"] == 64 and row["int4_leaves"] == 4 * int(LAYERS) and row["int8_leaves"] == 0
    assert row["compiled_weight_bytes"] == _int4_weight_bytes(group)
    assert row["argument_bytes"] >= row["compiled_weight_bytes"]
    assert row["large_buffers"] == []  # int4 buffers count half a byte a value: never listed


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.full] if c in TPU_IN_FULL_ONLY else []) for c in TPU_CASES]
)
def test_tpu_int4_step_holds_int4_weights_without_a_wider_copy(request, case):
    rows = request.getfixturevalue("tpu_full_results" if case in TPU_IN_FULL_ONLY else "tpu_results")
    _assert_int4_program(rows[case], 128 if case.endswith("-g128") else None)


def test_gpu_int4_step_holds_int4_weights_without_a_wider_copy(gpu_results):
    _assert_int4_program(gpu_results[GPU_CASES[0]], None)
