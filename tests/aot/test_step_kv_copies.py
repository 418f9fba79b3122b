# SPDX-License-Identifier: Apache-2.0
"""The compiled model step holds no copy of its KV cache, and its temp memory does not grow with it.

The runner's forward (2-layer Llama, abstract weights, all layers' caches in one array) is
compiled by the real TPU and GPU compilers (`tests.aot.step_compile`, in a subprocess that has
them) for a decode and a prefill bucket, each with a 128 MiB and a 256 MiB cache (smaller caches
may be staged whole in a TPU's VMEM by XLA, a copy this test would flag). A step whose
KV write and attention disagree on the cache's layout converts the whole cache array before
each layer: a `copy` (or a fusion, transpose or convert) of cache size in the optimized HLO and
temp memory as large as the cache. Views, in-place update fusions and custom calls aliasing
their output to an operand make no new buffer and pass.
"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

MIB = 1 << 20
CACHE_MIB = (128, 256)
BUCKETS = {"decode": 64, "prefill": 1024}
TARGETS = [("v6e-1", "pallas_tpu", "tpu"), ("h100x1", "pallas_gpu", "cuda")]
# Temp may differ between the two cache sizes by a little (XLA schedules the weights' prefetches
# a little differently), never by anything near the 128 MiB the cache grows by.
TEMP_TOLERANCE_BYTES = 4 * MIB


@pytest.fixture(scope="module", params=TARGETS, ids=[t[0] for t in TARGETS])
def compiled_steps(request) -> dict[tuple[str, int], dict]:
    target, backend, platform = request.param
    specs = [f"{tokens}:{mib}" for tokens in BUCKETS.values() for mib in CACHE_MIB]
    results = run_worker(platform, "step_compile", target, backend, "small", *specs)
    return {(r["num_tokens"], r["cache_bytes"] // MIB): r for r in results}


@pytest.mark.parametrize("bucket", BUCKETS)
def test_no_cache_sized_buffer_but_the_cache(compiled_steps, bucket):
    for mib in CACHE_MIB:
        step = compiled_steps[BUCKETS[bucket], mib]
        assert step["large_buffers"] == [], (
            f"{step['target']} {bucket} step with a {mib} MiB cache makes cache-sized buffers "
            f"(layout conversions of the cache?): {step['large_buffers']}"
        )


@pytest.mark.parametrize("bucket", BUCKETS)
def test_temp_memory_does_not_grow_with_the_cache(compiled_steps, bucket):
    small, large = (compiled_steps[BUCKETS[bucket], mib] for mib in CACHE_MIB)
    assert abs(large["temp_bytes"] - small["temp_bytes"]) <= TEMP_TOLERANCE_BYTES, (small, large)
    assert large["temp_bytes"] < large["cache_bytes"] // 8, large
    assert large["alias_bytes"] >= large["cache_bytes"], "the donated cache is not updated in place"
