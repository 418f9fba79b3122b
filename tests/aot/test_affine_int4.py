# SPDX-License-Identifier: Apache-2.0
"""An affine int4 projection (values, scales and offsets per 128 inputs: AWQ, asymmetric GPTQ;
`models.int4`) compiled by the real TPU and GPU compilers at Llama 3.1 8B's MLP width
(`affine_int4_worker`): the values stay an int4 argument and the optimized program makes no
buffer as large as a byte a weight (no bfloat16 or int8 copy of the weight), the offsets'
product being a `[T, in / 128] x [in / 128, out]` dot. On GPU at a few tokens (decode of a few
sequences); at more, a grouped int4 kernel is multiplied per group or dequantized as a
symmetric one is (`models.int8.int8_dot_on_gpu`), not asserted here."""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

SIZES = ("4096", "14336", "128")  # inputs, outputs, group size


@pytest.mark.parametrize(("platform", "target", "tokens"), [("tpu", "v6e-1", "64"), ("cuda", "h100x1", "8")])
def test_affine_int4_projection_holds_int4_values_without_a_wider_copy(platform, target, tokens):
    row = run_worker(platform, "affine_int4_worker", target, tokens, *SIZES, timeout=900)
    assert row["int4_values"] and row["large_buffers"] == []
