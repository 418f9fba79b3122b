# SPDX-License-Identifier: Apache-2.0
"""A grouped int8 projection (Q8_0's layout) compiled for an H100 keeps its temporary memory
within a bfloat16 copy of the weight at any token count (`int8_grouped_gpu_worker`): per-group
products at a few tokens, where their float32 buffer is the smaller, the weight dequantized to
bfloat16 beyond, where that buffer (4 T / G bytes a weight) would grow with the batch."""

from __future__ import annotations

from tests.aot.toolchains import run_worker


def test_grouped_int8_temporary_memory_stays_within_a_bfloat16_weight_copy():
    per_weight = run_worker("cuda", "int8_grouped_gpu_worker", "h100x1", "8,64,512", timeout=600)
    assert per_weight["8"] <= 1.1  # per group: 4 * 8 / 32 bytes a weight
    assert per_weight["64"] <= 2.5 and per_weight["512"] <= 2.5  # a bfloat16 copy, not 8 or 64
