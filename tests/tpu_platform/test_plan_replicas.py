# SPDX-License-Identifier: Apache-2.0
"""The planner's data-parallel replicas and experts split over them (`tpu_platform.planner.replicas`),
against figures worked by hand from the models' published shapes; no compiler needed."""

import pytest
from jax.sharding import AbstractMesh

from tpu_platform.planner.plan import StepSetup, model_config
from tpu_platform.planner.replicas import chip_weights, plan_replicas

GIB = 1 << 30
V6E_BUDGET = int(32 * GIB * 0.9)  # a v6e chip's 32 GiB at the default 0.9 utilization
PAGE_TOKENS = 16  # the TPU page of a bfloat16 cache


def test_llama_8b_replicas_each_hold_the_one_chip_model_and_its_own_cache():
    setup = StepSetup(model_config("llama-3.1-8b"), "v6e-8", max_model_len=2048)
    plan = plan_replicas(setup, 8, step_bytes=GIB)
    # 8,030,261,248 parameters (model card) in bfloat16 and the RoPE table (2048 x 128 float32).
    weights = 2 * 8_030_261_248 + 2048 * 128 * 4
    assert (plan.chips, plan.weights.total_bytes, plan.weights.expert_bytes) == (8, weights, 0)
    # A token: 32 layers x K and V x 8 heads x 128 x 2 bytes; a page 16 of them.
    page = PAGE_TOKENS * 32 * 2 * 8 * 128 * 2
    assert plan.page_bytes == page
    pages = (V6E_BUDGET - weights - GIB) // page  # 13,788,451,635 B left: 6574 pages
    assert plan.num_pages == pages == 6574
    assert plan.kv_tokens == 6574 * 16 == 105_184
    assert plan.total_kv_tokens == 8 * 105_184


def test_qwen3_30b_experts_over_four_replicas_of_two_chips_leave_room_for_a_cache():
    """Qwen3-30B-A3B, 4 replicas x TP=2 on v6e-8. Per chip, a replica's half of attention and the
    vocabulary: each of 48 layers' fused q/k/v [2048, 5120] and o [4096, 2048] halves (10,485,760 +
    8,388,608 B), its router [2048, 128], q/k norms and two layer norms whole (524,288 + 512 +
    8192 B); the embedding and head halves (2 x 75968 x 2048 x 2 B), the final norm and the RoPE
    table (2048 x 128 float32)."""
    setup = StepSetup(model_config("qwen3-30b-a3b"), "v6e-8", tp_size=2, max_model_len=2048)
    layer = 10_485_760 + 8_388_608 + 524_288 + 512 + 8192
    other = 48 * layer + 2 * 75_968 * 2048 * 2 + 2048 * 2 + 2048 * 128 * 4
    all_experts = 48 * 128 * 3 * 2048 * 768 * 2  # 57,982,058,496 B

    over_replicas = plan_replicas(setup, 4, GIB, experts_over_replicas=True)
    assert over_replicas.weights.expert_bytes == all_experts // 8 == 16 * 48 * 3 * 2048 * 768 * 2
    assert over_replicas.weights.other_bytes == other == 1_554_935_808
    # A token: 48 layers x K and V x 2 of the 4 KV heads x 128 x 2 bytes.
    page = PAGE_TOKENS * 48 * 2 * 2 * 128 * 2
    pages = (V6E_BUDGET - all_experts // 8 - other - GIB) // page
    assert over_replicas.num_pages == pages == 26_763
    assert over_replicas.total_kv_tokens == 4 * 26_763 * 16

    # Served today: each replica holds all the experts, half a chip: nothing is left for a cache.
    within = plan_replicas(setup, 4, GIB)
    assert within.weights.expert_bytes == all_experts // 2
    assert within.weights.other_bytes == other
    assert within.num_pages == 0


def test_one_replica_with_experts_by_index_matches_the_tensor_parallel_placement():
    # One replica of 8 chips with its experts by index holds what the EP program's chip holds.
    ep = StepSetup(model_config("qwen3-30b-a3b"), "v6e-8", tp_size=8, expert_parallel=True)
    assert plan_replicas(ep, 1, 0, experts_over_replicas=True).weights == chip_weights(ep)
    tp = StepSetup(model_config("qwen3-30b-a3b"), "v6e-8", tp_size=8)
    # Inside each expert (F split) or by index: an eighth of the experts' bytes either way.
    assert chip_weights(tp).expert_bytes == chip_weights(ep).expert_bytes == 48 * 16 * 3 * 2048 * 768 * 2


def test_replicas_that_do_not_fit_the_target_or_split_the_experts_are_refused_by_name():
    llama = StepSetup(model_config("llama-3.1-8b"), "v6e-8", tp_size=4)
    with pytest.raises(ValueError, match=r"4 replicas of tp_size=4 need 16 chips .* use 1 to 2 replicas"):
        plan_replicas(llama, 4, 0)
    qwen = StepSetup(model_config("qwen3-30b-a3b"), "v6e-8")
    with pytest.raises(ValueError, match=r"128 routed experts do not divide by 6"):
        plan_replicas(qwen, 6, 0, experts_over_replicas=True)
    with pytest.raises(ValueError, match=r"0 routed experts do not divide by 8"):
        plan_replicas(StepSetup(model_config("llama-3.1-8b"), "v6e-8"), 8, 0, experts_over_replicas=True)


@pytest.mark.slow  # a second expert-parallel plan (fast: Qwen3-30B's replicas)
def test_qwen3_235b_over_a_16_chip_v6e_slice_holds_a_sixteenth_of_its_experts_a_chip():
    """Qwen3-235B-A22B (`model_configs/qwen3-235b-a22b.json`, the released config): 94 layers of
    128 experts of 1536 over a hidden size of 4096, 235.09e9 parameters; at EP=16 a chip holds 8
    whole experts a layer."""
    config = model_config("qwen3-235b-a22b")
    one_chip = StepSetup(config, "v6e-16", max_model_len=2048).abstract_model()
    assert one_chip.weight_bytes == pytest.approx(2 * 235.09e9, rel=1e-4)
    setup = StepSetup(config, "v6e-16", tp_size=16, expert_parallel=True, max_model_len=2048)
    chip = chip_weights(setup)
    assert chip.expert_bytes == 94 * 8 * 3 * 4096 * 1536 * 2
    # Beside them a sixteenth of attention (4 KV heads repeated to 16, one a chip) and of the
    # vocabulary: 1.16 GiB, leaving 1.2 GiB of a chip's 28.8 GiB budget for the steps and cache.
    assert GIB < chip.other_bytes < 1.2 * GIB
    assert V6E_BUDGET - chip.total_bytes == pytest.approx(1.2 * GIB, rel=0.05)


def test_a_planner_row_as_replicas_keeps_the_compiled_programs_step_bytes():
    import argparse

    from benchmarks.plan import _with_replicas

    setup = StepSetup(model_config("llama-3.1-8b"), "v6e-8", max_model_len=2048)
    weights, page = 2 * 8_030_261_248 + 2048 * 128 * 4, PAGE_TOKENS * 32 * 2 * 8 * 128 * 2
    # A compiled one-chip row: the steps keep 1 GiB and a part of a page beside weights and cache.
    kv = (V6E_BUDGET - weights - GIB) // page * page
    row = {"fits": True, "budget_bytes": V6E_BUDGET, "weight_bytes": weights, "kv_bytes": kv}
    args = argparse.Namespace(dp=8, ep=False, batch=64, context=2048, memory_utilization=0.9)
    replicas = _with_replicas(dict(row), setup, args)["replicas"]
    # Each replica is that program: its chip, its cache; eight of them.
    assert (replicas["weight_bytes"], replicas["kv_bytes"]) == (weights, kv)
    assert replicas["total_kv_tokens"] == 8 * replicas["kv_tokens"] == 8 * kv // page * PAGE_TOKENS
    assert replicas["batch_fits"] == (kv // page * PAGE_TOKENS >= 64 * 2048)
    # Without --dp the row is left as compiled.
    one = argparse.Namespace(**{**vars(args), "dp": 1})
    assert "replicas" not in _with_replicas(dict(row), setup, one)


@pytest.mark.parametrize(("replicas", "chips_each"), [(8, 1), (4, 2)])
def test_replicas_in_one_program_place_a_chip_s_experts_as_the_arithmetic_counts(replicas, chips_each):
    """8 replicas of one chip, or 4 of two, in one program (`tpu_platform.replica_step`, the
    planner's `--dp 8 --ep --tp 1` and `--dp 4 --ep --tp 2`): the mesh places on a chip 16 whole
    experts a layer and its replica's share of everything else, what `chip_weights` counts with
    the experts over the 8 chips."""
    setup = StepSetup(
        model_config("qwen3-30b-a3b"), "v6e-8", max_model_len=2048, expert_parallel=True,
        dp_size=replicas, tp_size=chips_each,
    )  # fmt: skip
    mesh = AbstractMesh((replicas, chips_each), ("data", "model"))  # `setup.mesh()`'s, on no chips
    placed = setup.abstract_model().chip_weight_bytes(mesh)
    assert placed == chip_weights(setup, 8).total_bytes
    assert chip_weights(setup, 8).expert_bytes == 48 * 16 * 3 * 2048 * 768 * 2


def test_replicas_in_one_program_fit_the_target_and_split_the_experts():
    qwen = model_config("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=r"dp_size=8 x tp_size=2 does not fit target 'v6e-8' .* at most 4"):
        StepSetup(qwen, "v6e-8", tp_size=2, dp_size=8, expert_parallel=True)
    with pytest.raises(ValueError, match=r"dp_size=16 x tp_size=1 does not fit target 'v6e-8'"):
        StepSetup(qwen, "v6e-8", dp_size=16, expert_parallel=True)
    with pytest.raises(ValueError, match=r"128 experts by index: 128 does not divide by 6"):
        StepSetup(qwen, "v6e-8", dp_size=6, expert_parallel=True)
