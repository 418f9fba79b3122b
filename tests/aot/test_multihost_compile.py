# SPDX-License-Identifier: Apache-2.0
"""The multi-host mesh program compiled for a 16-chip TPU slice of 4 hosts (v5e-16, `v5e:4x4`).

The worker (`multihost_compile_worker`) builds the mesh the way the hosts build it at run time
(`tpu_platform.hosts.per_host_devices` over the topology's devices, which carry their host) and
compiles the runner's sharded decode step of Llama-3.1-8B at TP=16 with the Mosaic TPU attention
kernel, weights abstract: its first 2 layers at full width in `make test` (the mesh, the split
and the per-layer all-reduces show as in 32), every layer in `make test-full` (`-m full`). A
compile error, a mesh that interleaves hosts, a program that is not split 16 ways, or one whose
weights are not split across the chips fails here.
"""

from __future__ import annotations

import pytest

from tests.aot.toolchains import run_worker

pytestmark = pytest.mark.timeout(3600)  # a multi-billion-parameter program: minutes when busy

V5E_HBM_BYTES = 16 << 30


@pytest.fixture(
    scope="module",
    params=[pytest.param(2, id="2-layers"), pytest.param(0, id="32-layers", marks=pytest.mark.full)],
)
def compiled(request) -> dict:
    args = ("v5e-16", "llama-3.1-8b", "16", "pallas_tpu", str(request.param))
    return run_worker("tpu", "multihost_compile_worker", *args)


def test_the_mesh_spans_four_hosts_each_contiguous(compiled):
    assert compiled["hosts"] == 4
    assert compiled["mesh_hosts"] == [h for h in range(4) for _ in range(4)]


def test_the_step_is_one_program_split_over_the_16_chips(compiled):
    assert compiled["num_partitions"] == 16
    # Row-parallel o_proj and down_proj: at least one all-reduce each a layer.
    assert compiled["all_reduces"] >= 2 * compiled["num_layers"]


def test_each_chip_holds_its_share_of_the_weights(compiled):
    share = compiled["weight_bytes"] / 16
    # Arguments per chip: its weight share (norms and RoPE tables replicated) and its KV pages.
    assert share < compiled["argument_bytes"] < 2 * share
    assert compiled["argument_bytes"] + compiled["temp_bytes"] < V5E_HBM_BYTES


# Expert parallelism across the hosts is the same placement on the same mesh: Qwen3-235B-A22B's
# first 2 layers at full width, its 128 experts split by index over the 16 chips of a v6e-16
# (4 hosts), 8 whole experts a chip. `make test-full`: minutes of compile on a busy machine.
@pytest.fixture(scope="module")
def compiled_ep() -> dict:
    return run_worker(
        "tpu", "multihost_compile_worker", "v6e-16", "qwen3-235b-a22b", "16", "pallas_tpu", "2", "ep"
    )


@pytest.mark.full
def test_experts_by_index_across_four_hosts_compile_to_one_program(compiled_ep):
    assert compiled_ep["mesh_hosts"] == [h for h in range(4) for _ in range(4)]
    assert compiled_ep["num_partitions"] == 16
    # every chip holds every token after attention's all-reduce: nothing is sent to the experts
    assert compiled_ep["all_to_alls"] == 0
    # attention's and each MoE layer's `[T, D]` sums
    assert compiled_ep["all_reduces"] >= 2 * compiled_ep["num_layers"]


@pytest.mark.full
def test_each_chip_holds_a_sixteenth_of_the_experts_whole(compiled_ep):
    # 8 of the 128 experts a chip, each whole (split inside each expert, the first axis stays 128)
    shares = compiled_ep["expert_shares"]
    assert shares and all(share[0] == compiled_ep["num_experts"] // 16 for share in shares), shares
    share = compiled_ep["weight_bytes"] / 16
    # a chip's experts (8 of 128) and the rest of its share, beside its KV pages; experts
    # replicated or split inside each expert but gathered would hold far more
    assert share < compiled_ep["argument_bytes"] < 2 * share
