# SPDX-License-Identifier: Apache-2.0
"""Gemma-4-E2B's whole step (35 layers: sliding layers of head dim 256 and full layers of 512 in
one cache shape, KV-shared layers, per-layer input embeddings) compiled by the real TPU compiler
for one v6e chip (`tests.aot.step_compile`, weights abstract): a decode and a prefill bucket,
the prefill at two cache sizes. It fits the chip, takes the weights and the cache and updates
the donated cache in place, makes no buffer as large as a cache array but the caches themselves
(no copy, convert or transpose of a cache), and its temporaries do not grow with the cache.
"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

# Three compiles of all 35 layers: `make test-full`. `make test` compiles Gemma 4's features for
# v6e where they live: head dim 512 in the kernel grids (test_compile_kernels_tpu.py).
pytestmark = pytest.mark.full

MIB = 1 << 20
TARGET, BACKEND, MODEL = "v6e-1", "pallas_tpu", "gemma-4-e2b"
SPECS = ("8:128", "1024:128", "1024:256")  # tokens:cache MiB
V6E_HBM = 32 << 30
# About 5B parameters in the text model (most of them the per-layer embeddings), bfloat16.
MIN_WEIGHT_BYTES = 2 * 4.8e9
# Temp may differ between the two cache sizes by a little (XLA schedules the weights' prefetches
# a little differently), never by anything near the 128 MiB the cache grows by.
TEMP_TOLERANCE_BYTES = 16 * MIB


@pytest.fixture(scope="module")
def steps() -> dict[str, dict]:
    results = run_worker("tpu", "step_compile", TARGET, BACKEND, MODEL, *SPECS, timeout=3500)
    return {spec: row for spec, row in zip(SPECS, results, strict=True)}


@pytest.mark.parametrize("spec", SPECS)
def test_step_fits_one_chip_and_updates_the_cache_in_place(steps, spec):
    step = steps[spec]
    assert step["argument_bytes"] >= MIN_WEIGHT_BYTES + step["cache_bytes"]
    assert step["alias_bytes"] >= step["cache_bytes"]
    assert step["argument_bytes"] + step["temp_bytes"] < V6E_HBM
    assert step["large_buffers"] == [], step["large_buffers"]


def test_temporaries_do_not_grow_with_the_cache(steps):
    small, large = steps["1024:128"], steps["1024:256"]
    assert large["cache_bytes"] == 2 * small["cache_bytes"]
    assert large["temp_bytes"] - small["temp_bytes"] <= TEMP_TOLERANCE_BYTES, (small, large)
