# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/stacked_weights.py`'s count of weights copied out of a stack, on programs XLA:CPU
compiles here: none where each weight is its own argument; every kernel of every layer where the
layers read static slices of one `[L, ...]` array per kind; one per kind (the loop body's dynamic
slice) under `lax.scan`; none where the native dense kernels take the stack and the layer's
index. The norm weights are smaller than a kernel and are not counted."""

from __future__ import annotations

import argparse

import jax
import pytest

from tests.benchmark_scripts import load_benchmark

LAYERS = 2


stacked_weights = load_benchmark("stacked_weights")


@pytest.mark.parametrize(
    "variant, copies",
    [
        ("per layer", 0),
        ("static slices", LAYERS * len(stacked_weights.KERNELS)),
        ("scan", len(stacked_weights.KERNELS)),
    ],
)
def test_weights_copied_out_of_a_stack_are_counted(variant, copies):
    args = argparse.Namespace(target=None, dense="xla", layers=LAYERS, rows=8)
    x, per, stacked, dense, weight_elements = stacked_weights._weights(args)
    function = stacked_weights._programs(LAYERS, dense)[variant]
    compiled = jax.jit(function).trace(x, per if variant == "per layer" else stacked).lower().compile()
    assert stacked_weights.materialized_weights(compiled.as_text(), weight_elements) == copies


def test_native_dense_kernels_read_each_layer_of_the_stack_in_place(dense_kernels):
    """Given the whole stack and each layer's index, the native kernel needs no copy, where
    the same kernel given static slices of the stack has every layer's weights copied out."""
    args = argparse.Namespace(target=None, dense="native", native_dtype="bfloat16", layers=LAYERS, rows=8)
    x, _, stacked, dense, weight_elements = stacked_weights._weights(args)
    programs = stacked_weights._programs(LAYERS, dense)
    for variant, copies in [("stack + index", 0), ("static slices", LAYERS * len(stacked_weights.KERNELS))]:
        compiled = jax.jit(programs[variant]).trace(x, stacked).lower().compile()
        assert stacked_weights.materialized_weights(compiled.as_text(), weight_elements) == copies
