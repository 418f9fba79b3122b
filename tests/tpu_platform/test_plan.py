# SPDX-License-Identifier: Apache-2.0
"""The planner's pure parts, no compiler needed: HLO traffic accounting on a hand-written program,
the KV-cache grouping, the abstract model's bytes and the decode roofline's arithmetic.
(`tests/aot/test_model_step.py` compiles the real programs.)"""

from collections import Counter

import jax
import pytest

from tpu_platform.planner.abstract_weights import abstract_model
from tpu_platform.planner.depth import depths_for, extrapolate, step_depths
from tpu_platform.planner.hlo import (
    ExpectedCollectives,
    hlo_collectives,
    hlo_traffic,
    shape_bytes,
    summarize_collectives,
    unexpected_collectives,
)
from tpu_platform.planner.kv import decode_roofline, kv_bytes_read, weight_bytes_read
from tpu_platform.planner.plan import StepSetup, known_models, model_config
from tpu_platform.planner.replicas import chip_weights
from tpu_platform.planner.targets import target
from tpu_platform.step_program import KVLayout
from tpu_platform.weights.preparation import Preparation, abstract_prepared

HLO = """HloModule m

%fused_computation (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  ROOT %neg = f32[4,8]{1,0} negate(%param_0)
}

ENTRY %main (p0: f32[4,8], /*index=1*/p1: bf16[16]) -> (f32[4,8], bf16[16]) {
  %p0 = f32[4,8]{1,0:T(8,128)} parameter(0)
  %p1 = bf16[16]{0} parameter(1)
  %fusion = f32[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/neg"}
  %copy = bf16[16]{0} copy(%p1)
  %cc = f32[4,8]{1,0} custom-call(%fusion, /*index=1*/%copy), custom_call_target="tpu_custom_call"
  %cs = (bf16[16]{0}, bf16[16]{0}, u32[]) copy-start(%copy)
  ROOT %t = (f32[4,8]{1,0}, bf16[16]{0}) tuple(%cc, %copy)
}
"""


def test_shape_bytes():
    assert shape_bytes("(f32[4,8]{1,0}, bf16[16]{0}, s32[], f8e4m3fn[2,3])") == 128 + 32 + 4 + 6


def test_shape_bytes_packs_4_bit_values_two_a_byte():
    # As the TPU compiler prints an int4 kernel (`E(4)`: 4-bit elements); an odd count rounds up.
    assert shape_bytes("s4[4096,14336]{1,0:T(8,128)(4,1)E(4)}") == 4096 * 14336 // 2
    assert shape_bytes("(u4[3]{0}, f4e2m1fn[8,2]{1,0}, f8e8m0fnu[8]{0})") == 2 + 8 + 8


def test_hlo_traffic_charges_an_int4_kernel_half_its_values():
    hlo = """HloModule m

ENTRY %main (p0: s4[1024,512], p1: bf16[8,1024]) -> bf16[8,512] {
  %p0 = s4[1024,512]{1,0:E(4)} parameter(0)
  %p1 = bf16[8,1024]{1,0} parameter(1)
  ROOT %cc = bf16[8,512]{1,0} custom-call(%p1, %p0), custom_call_target="int4_matmul"
}
"""
    # The kernel reads the activations and the packed kernel once and writes its result.
    assert hlo_traffic(hlo).total_bytes == 8 * 1024 * 2 + 1024 * 512 // 2 + 8 * 512 * 2


def test_hlo_traffic_counts_operands_and_results_outside_fusions():
    traffic = hlo_traffic(HLO)
    # fusion reads 128 B and writes 128; copy 32 + 32; the kernel reads 128 + 32 and writes 128;
    # copy-start reads and writes 32; the fused negate, parameters and tuple move nothing.
    kinds = {kind: (moved, count) for kind, moved, count in traffic.by_kind}
    assert kinds == {
        "custom-call tpu_custom_call": (288, 1), "fusion kLoop": (256, 1),
        "copy": (64, 1), "copy-start": (64, 1),
    }  # fmt: skip
    assert traffic.total_bytes == 672
    assert traffic.largest[0] == ("custom-call tpu_custom_call", "cc", 288)
    assert traffic.largest[1] == ("fusion kLoop", "jit(f)/neg", 256)


# A tensor-parallel step's collectives as TPU (synchronous) and GPU (async start/done pairs) print
# them: the embedding's and two layers' sums (one pair combined in a tuple), the logits gathered.
COLLECTIVES_HLO = """HloModule step

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%a, %b)
}

ENTRY %main (p0: bf16[64,1024], p1: f32[64,32064], p2: bf16[1024,32064]) -> f32[64,128256] {
  %p0 = bf16[64,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = f32[64,32064]{1,0} parameter(1)
  %p2 = bf16[1024,32064]{1,0} parameter(2)
  %psum = bf16[64,1024]{1,0:T(8,128)(2,1)} all-reduce(%p0), to_apply=%add, metadata={op_name="psum"}
  %ar-start = f32[64,1024]{1,0} all-reduce-start(%p0), to_apply=%add, metadata={op_name="o_proj"}
  %ar-done = f32[64,1024]{1,0} all-reduce-done(%ar-start), metadata={op_name="o_proj"}
  %pair = (bf16[64,1024]{1,0}, bf16[64,1024]{1,0}) all-reduce(%psum, %p0), to_apply=%add
  %cp-start = (f32[64,32064]{1,0}, f32[64,32064]{1,0}, u32[], u32[]) collective-permute-start(%p1)
  %cp-done = f32[64,32064]{1,0} collective-permute-done(%cp-start)
  %ag-start = (f32[64,32064]{0,1}, f32[64,128256]{0,1}) all-gather-start(%cp-done), dimensions={1}
  %ag-done = f32[64,128256]{0,1} all-gather-done(%ag-start)
  %weight = bf16[1024,128256]{0,1} all-gather(%p2), dimensions={1}, metadata={op_name="head"}
  ROOT %t = f32[64,128256]{0,1} copy(%ag-done)
}
"""


def test_hlo_collectives_reads_sync_async_and_combined_collectives():
    found = hlo_collectives(COLLECTIVES_HLO)
    assert [c.kind for c in found] == [
        "all-reduce", "all-reduce", "all-reduce", "collective-permute", "all-gather", "all-gather",
    ]  # fmt: skip
    psum, started, pair, permute, logits, weight = found
    assert psum.operands == psum.results == (("bf16", (64, 1024)),) and psum.op_name == "psum"
    # An async pair: the operand of the start, the result of the done.
    assert started.operands == (("bf16", (64, 1024)),) and started.results == (("f32", (64, 1024)),)
    assert pair.results == (("bf16", (64, 1024)),) * 2 and pair.result_elements == (65536, 65536)
    assert permute.results == (("f32", (64, 32064)),)
    assert logits.operands == (("f32", (64, 32064)),) and logits.results == (("f32", (64, 128256)),)
    assert weight.result_bytes == 2 * 1024 * 128256
    summary = {(row["kind"], row["results"]): row["count"] for row in summarize_collectives(found)}
    assert summary[("all-reduce", "bf16[64,1024]")] == 1
    assert summary[("all-reduce", "bf16[64,1024], bf16[64,1024]")] == 1
    assert summary[("all-gather", "f32[64,128256]")] == 1


def test_unexpected_collectives_names_what_the_rules_do_not_imply():
    found = hlo_collectives(COLLECTIVES_HLO)
    # Four sums of [64, 1024] activations (the combined pair counts twice), the logits gathered.
    expected = ExpectedCollectives(
        activation_elements=64 * 1024, all_reduces=4, logits_elements=64 * 128256,
        weight_floor_bytes=2 * 1024 * 32064 * 4,
    )  # fmt: skip
    problems = unexpected_collectives(found, expected)
    assert problems == [
        "unexpected collective-permute of f32[64, 32064] from cp-start",
        "unexpected all-gather of bf16[1024, 128256] (as large as a whole weight) from head",
    ]
    clean = [c for c in found if c.kind == "all-reduce" or c.results[0] == ("f32", (64, 128256))]
    assert unexpected_collectives(clean, expected) == []
    wrong = ExpectedCollectives(64 * 1024, 6, 0, 1 << 40)
    assert unexpected_collectives(clean, wrong) == [
        "unexpected all-gather of f32[64, 128256] from ag-start",
        "4 all-reduces of [tokens, hidden] activations (65536 elements), expected 6",
    ]


def test_kv_layout_groups_sliding_and_full_layers_as_the_engine_does():
    gemma = model_config("gemma-2-9b")  # 42 layers, even ones sliding
    layout = KVLayout.for_model(gemma)
    assert (layout.num_groups, layout.num_caches) == (2, 21)
    assert layout.layer_groups[:4] == (0, 1, 0, 1)
    assert layout.layer_caches[:4] == (0, 0, 1, 1) and layout.layer_caches[-1] == 20
    llama = KVLayout.for_model(model_config("llama-3.1-8b"))
    assert (llama.layer_groups, llama.num_caches, llama.num_groups) == ((), 32, 1)


def test_known_models_and_errors(tmp_path):
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "gemma-2-9b", "qwen3-30b-a3b"} <= set(known_models())
    with pytest.raises(ValueError, match="neither a known model"):
        model_config(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="unknown compile target"):
        StepSetup(model_config("qwen3-8b"), "v9z-1")


def test_tensor_parallel_setups_that_cannot_work_are_refused_by_name():
    llama = model_config("llama-3.1-70b")  # 64 query heads, 8 KV heads
    with pytest.raises(ValueError, match=r"tp_size=8 does not fit target 'v6e-4' of 4 chip\(s\)"):
        StepSetup(llama, "v6e-4", tp_size=8)
    with pytest.raises(ValueError, match="64 query heads do not divide by 3"):
        StepSetup(llama, "v6e-8", tp_size=3)
    qwen = StepSetup(model_config("qwen3-30b-a3b"), "h100x8", tp_size=8)  # 4 KV heads: each on 2 chips
    assert qwen.kv_heads == 8


def test_abstract_weights_have_the_published_size():
    # Llama-3.1-8B: 8,030,261,248 parameters (model card), bfloat16; plus the RoPE table.
    state = abstract_model(model_config("llama-3.1-8b"), "bfloat16", 2048)
    assert state.weight_bytes == 2 * 8_030_261_248 + 2048 * 128 * 4


def test_decode_roofline_arithmetic():
    setup = StepSetup(model_config("llama-3.1-8b"), "v6e-1", max_model_len=2048)
    # 64 sequences x 2048 tokens x 32 layers x (K and V) x 8 heads x 128 x 2 bytes
    assert kv_bytes_read(setup, 64, 2048) == 64 * 2048 * 32 * 2 * 8 * 128 * 2
    roof = decode_roofline(setup, 64, 2048)
    assert roof["seconds"] == pytest.approx((16_061_571_072 + 64 * 2048 * 131072) / 1640e9)
    gemma = StepSetup(model_config("gemma-2-9b"), "h100x1", max_model_len=8192)
    # 21 sliding layers read at most their 4096-token window, 21 full layers the whole context.
    per_token = 2 * 8 * 256 * 2
    assert kv_bytes_read(gemma, 1, 8192) == (21 * 4096 + 21 * 8192) * per_token


def test_moe_decode_reads_the_experts_a_batch_touches():
    setup = StepSetup(model_config("qwen3-30b-a3b"), "h100x1")
    total = abstract_model(setup.config, "bfloat16", 2048).weight_bytes
    expert = 3 * 2048 * 768 * 2
    # one token touches 8 of 128 experts in each of 48 layers
    assert weight_bytes_read(setup, 1) == pytest.approx(total - 48 * 120 * expert, rel=1e-9)
    assert weight_bytes_read(setup, 4096) == pytest.approx(total, rel=1e-6)


@pytest.mark.parametrize(("replicas", "chips_each"), [(8, 1), (4, 2)])
def test_moe_decode_over_replicas_reads_a_chip_s_experts_every_replica_s_tokens_touch(replicas, chips_each):
    """The experts over 8 chips of replicas: a chip holds 16 of the 128 whole experts a layer
    and its replica's share of the rest (`chip_weights`), and every replica's tokens reach them."""
    setup = StepSetup(
        model_config("qwen3-30b-a3b"), "v6e-8", max_model_len=2048, expert_parallel=True,
        dp_size=replicas, tp_size=chips_each,
    )  # fmt: skip
    chip = chip_weights(setup, 8)
    assert chip.expert_bytes == 48 * 16 * 3 * 2048 * 768 * 2
    # one token a replica: each replica's token touches 8 of the 128 experts a layer
    untouched = chip.expert_bytes * (120 / 128) ** replicas
    assert weight_bytes_read(setup, 1) == pytest.approx(chip.total_bytes - untouched, rel=1e-9)
    assert weight_bytes_read(setup, 64) == pytest.approx(chip.total_bytes, rel=1e-6)


@pytest.mark.slow  # a 120B model's abstract shapes; the fast tier's planner weights are int8's
def test_gpt_oss_weights_are_its_mxfp4_experts_and_bfloat16_rest():
    # gpt-oss-120b as released: 116.83e9 parameters (model card), of which the 36 layers' 128
    # experts' kernels (3 * 2880 * 2880 each) are mxfp4, 17 bytes per 32 values; the rest bfloat16.
    config = model_config("gpt-oss-120b")
    assert config.mxfp4
    experts = 36 * 128 * 3 * 2880 * 2880
    total = abstract_model(config, "bfloat16", 2048).weight_bytes
    assert total == pytest.approx(experts * 17 / 32 + 2 * (116.83e9 - experts), rel=0.01)  # ~65 GB, not ~234
    # At TP=8 the experts' 90 blocks of 32 are padded to 96, 12 a chip.
    padded = StepSetup(config, "h100x8", tp_size=8).abstract_model().weight_bytes
    assert padded - total == pytest.approx(36 * 128 * 3 * 2880 * 192 * 17 / 32, rel=0.01)
    # one token touches 4 of 128 experts in each of 36 layers
    setup = StepSetup(config, "h100x1")
    expert = 3 * 2880 * 2880 * 17 // 32
    assert weight_bytes_read(setup, 1) == pytest.approx(total - 36 * 124 * expert, rel=1e-9)


def test_int8_weights_are_the_runners_int8_preparation():
    config = model_config("llama-3.2-3b")
    setup = StepSetup(config, "v5e-1", max_model_len=2048, quantization="int8")
    int8 = setup.abstract_model()
    # The runner's int8 weights, restored from a prepared checkpoint: the same leaves, plus the
    # RoPE tables the runner attaches (`max_model_len` rows).
    _, served = abstract_prepared(config, Preparation("bfloat16", quantization="int8"))
    served_leaves = Counter((leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(served))
    planned_leaves = Counter((leaf.shape, leaf.dtype) for leaf in int8.leaves)
    assert served_leaves - planned_leaves == Counter()
    assert {shape[0] for shape, _ in planned_leaves - served_leaves} == {2048}
    # Every dense kernel int8 (and the tied head's copy), with a float32 scale per output channel;
    # the embedding table and the norms stay bfloat16.
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kernels = config.num_layers * (
        hidden * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        + config.num_heads * config.head_dim * hidden + 3 * hidden * inner
    ) + hidden * vocab  # fmt: skip
    bf16 = abstract_model(config, "bfloat16", 2048)
    scales = config.num_layers * ((config.num_heads + 2 * config.num_kv_heads) * config.head_dim
                                  + hidden + 2 * inner + hidden) + vocab  # fmt: skip
    assert bf16.weight_bytes - int8.weight_bytes == 2 * kernels - (kernels + 4 * scales)
    # The decode roofline reads the int8 bytes.
    assert weight_bytes_read(setup, 64) == int8.weight_bytes
    assert (
        decode_roofline(setup, 64, 2048)["seconds"]
        < decode_roofline(StepSetup(config, "v5e-1", max_model_len=2048), 64, 2048)["seconds"]
    )


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"quantization 'int2' is not one the planner knows; use one of none, int8"
    ):
        StepSetup(model_config("llama-3.1-8b"), "v5e-1", quantization="int2")


@pytest.mark.slow  # the same arithmetic as int8's (fast) on fp8 bytes
def test_fp8_weights_are_fp8_bytes_and_scales_with_a_bfloat16_head():
    """Llama 3.1 8B in fp8: each projection one byte a weight plus a float32 scale per output
    channel, or per 128 inputs of each (block checkpoints); the untied head, the embedding and
    the norms stay bfloat16."""
    config = model_config("llama-3.1-8b")
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_layers
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    attention_out = config.num_heads * config.head_dim
    kernels = layers * (hidden * qkv + attention_out * hidden + 3 * hidden * inner)
    bf16 = abstract_model(config, "bfloat16", 2048).weight_bytes
    channel = StepSetup(config, "v6e-1", max_model_len=2048, quantization="fp8").abstract_model()
    scales = layers * (qkv + hidden + 2 * inner + hidden)
    assert bf16 - channel.weight_bytes == 2 * kernels - (kernels + 4 * scales)
    blocks = StepSetup(config, "v6e-1", max_model_len=2048, quantization="fp8-g128").abstract_model()
    assert blocks.weight_bytes - channel.weight_bytes == 4 * (kernels // 128 - scales)


@pytest.mark.slow  # a quantized format's expert reads: the fast tier's MoE decode read is bfloat16's
def test_moe_fp8_block_decode_reads_fp8_experts_and_their_group_scales():
    fp8 = StepSetup(model_config("qwen3-30b-a3b"), "h100x1", quantization="fp8-g128")
    total = fp8.abstract_model().weight_bytes
    expert = 3 * 2048 * 768 + 4 * 3 * 2048 * 768 // 128  # fp8 kernels, a scale per 128 inputs
    assert weight_bytes_read(fp8, 1) == pytest.approx(total - 48 * 120 * expert, rel=1e-9)


@pytest.mark.slow  # a quantized format's expert reads: the fast tier's MoE decode read is bfloat16's
def test_moe_int8_decode_reads_int8_experts():
    int8 = StepSetup(model_config("qwen3-30b-a3b"), "h100x1", quantization="int8")
    total = int8.abstract_model().weight_bytes
    expert = 3 * 2048 * 768 + 4 * (2 * 768 + 2048)  # int8 kernels, float32 scales per output channel
    assert weight_bytes_read(int8, 1) == pytest.approx(total - 48 * 120 * expert, rel=1e-9)


@pytest.mark.slow  # the same arithmetic as int8's (fast) with offsets
def test_affine_int4_weights_add_an_offset_beside_each_dense_scale():
    """Llama 3.2 3B as an AWQ checkpoint serves it (`int4z-g128`): the symmetric 4-bit layout's
    bytes plus a float32 offset per scale of every dense projection (the head stays bfloat16)."""
    config = model_config("llama-3.2-3b")
    hidden, inner = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    kernels = config.num_layers * (
        hidden * qkv + config.num_heads * config.head_dim * hidden + 3 * hidden * inner
    )
    symmetric, affine = (
        StepSetup(config, "v6e-1", max_model_len=2048, quantization=q).abstract_model()
        for q in ("int4-g128", "int4z-g128")
    )
    assert affine.weight_bytes - symmetric.weight_bytes == 4 * kernels // 128
    bf16 = abstract_model(config, "bfloat16", 2048).weight_bytes
    assert bf16 - symmetric.weight_bytes == 2 * kernels - (kernels // 2 + 4 * kernels // 128)


@pytest.mark.slow  # a quantized format's expert reads: the fast tier's MoE decode read is bfloat16's
def test_moe_affine_int4_decode_reads_4_bit_experts():
    int4z = StepSetup(model_config("qwen3-30b-a3b"), "h100x1", quantization="int4z-g128")
    total = int4z.abstract_model().weight_bytes
    # int4 kernels, two values a byte, a float32 scale per 128 inputs; the experts carry no offsets.
    expert = 3 * 2048 * 768 // 2 + 4 * 3 * 2048 * 768 // 128
    assert weight_bytes_read(int4z, 1) == pytest.approx(total - 48 * 120 * expert, rel=1e-9)


def test_short_programs_hold_sparse_layers_past_a_dense_prefix():
    # DeepSeek-V3's first three layers are dense: cut to 2 and 4 layers the slope would be a
    # dense layer's; at 4 and 6 both programs hold sparse layers and the slope is a sparse one's.
    v3 = model_config("deepseek-v3")
    assert depths_for(v3) == (4, 6)
    assert [v3.is_moe_layer(i) for i in range(6)] == [False] * 3 + [True] * 3
    # One dense layer (DeepSeek-V2-Lite, GLM-4.5-Air), none, or no experts: the first 2 and 4.
    for name in ("deepseek-v2-lite", "glm-4.5-air", "gpt-oss-120b", "llama-4-scout", "llama-3.1-8b"):
        assert depths_for(model_config(name)) == (2, 4), name


def test_one_depth_bounds_what_two_depths_extrapolate_from_above():
    # A step's bytes beyond the weights and cache: a part the depth does not change, one a layer.
    for fixed, per_layer in ((0, 7), (100, 0), (300, 11)):
        beyond = {depth: fixed + per_layer * depth for depth in (2, 4)}
        assert extrapolate([beyond[2], beyond[4]], (2, 4), 80) == fixed + per_layer * 80
        assert fixed + per_layer * 80 <= extrapolate([beyond[2]], (2,), 80) == beyond[2] * 40
    assert extrapolate([-5], (2,), 80) == 0 and extrapolate([10, 6], (2, 4), 80) == 10


def test_a_step_up_at_the_shallowest_depth_is_not_repeated_for_every_layer():
    # XLA may keep less live in the shallowest program than in every deeper one (a one-off step
    # up from 2 to 3 layers and more, not a per-layer growth): the line through 2 and 4 layers
    # repeats the step for each layer; the slope between the deeper depths does not.
    fixed, per_layer, step_up, layers = 200, 5, 170, 48

    def beyond(depth: int) -> int:
        return fixed + per_layer * depth + (step_up if depth > 2 else 0)

    whole = beyond(layers)
    assert extrapolate([beyond(2), beyond(4)], (2, 4), layers) > whole + step_up * 10
    depths = step_depths((2, 4), "decode")
    assert depths == (2, 4, 6)
    assert extrapolate([beyond(d) for d in depths], depths, layers) == whole
    # A step down (buffers reused once deep enough) is not extrapolated below any measured depth.
    assert extrapolate([100, 150, 120], (2, 4, 6), 48) == 150
    # Three depths on a straight line agree with two.
    line = [fixed + per_layer * d for d in depths]
    assert extrapolate(line, depths, layers) == extrapolate(line[:2], depths[:2], layers)


def test_an_moe_decode_step_gets_a_third_depth_and_a_one_prefill_the_shallowest():
    assert step_depths((4, 6), "decode") == (4, 6, 8)  # past DeepSeek-V3's dense prefix
    assert step_depths((4, 8), "decode") == (4, 8, 12)  # a hybrid's whole runs of its pattern
    assert step_depths((2, 4), "prefill") == (2, 4)
    assert step_depths((2, 4), "prefill", one_prefill=True) == (2,)
    assert step_depths((2, 4), "decode", routed_experts=False) == (2, 4)  # a dense model's line


@pytest.mark.slow  # the abstract 671B model in every format takes seconds to trace
def test_deepseek_v3_needs_more_than_a_v6e_8_in_every_format_and_fits_8_h100s_in_int4():
    """DeepSeek-V3's weights split over 8 chips (each chip holds at least an eighth): in int4
    with a scale per 128 inputs, the fewest bytes of any format the planner knows, more than a
    v6e chip's budget, less than an H100's with room for the latent cache."""
    config = model_config("deepseek-v3")
    int4 = abstract_model(config, "bfloat16", 2048, 8, "int4-g128", backend="tpu")
    parameters = 671.03e9  # the model card's, less the multi-token-prediction layer we skip
    assert int4.weight_bytes == pytest.approx(parameters / 2 * (1 + 8 / 128), rel=0.05)
    per_chip = int4.weight_bytes / 8
    assert per_chip > 0.9 * target("v6e-8").hbm_bytes
    assert per_chip < 0.6 * target("h100x8").hbm_bytes


def test_an_eagle3_head_beside_llama_8b_takes_its_published_size_and_a_one_layer_page():
    from tpu_platform.planner.draft import eagle3_head_like, eagle3_memory

    setup = StepSetup(model_config("llama-3.1-8b"), "v6e-1", max_num_seqs=16, max_model_len=2048)
    memory = eagle3_memory(setup, eagle3_head_like(setup))
    h, inter, vocab, draft_vocab, kv = 4096, 14336, 128256, 32000, 8 * 128
    params = (
        vocab * h  # its own embedding
        + 3 * h * h  # the fc over three target layers' states
        + 2 * h * (h + 2 * kv)
        + h * h  # q, k, v read [embedding, state]; o
        + 3 * h * inter  # gated MLP
        + draft_vocab * h  # the draft vocabulary's head
    )
    norms = 4 * h  # hidden, input, post-attention and final norms, float
    assert params * 2 <= memory.weight_bytes <= params * 2 + norms * 4 + draft_vocab * 8
    # One layer's keys and values: 128 tokens x 8 heads x 128 x 2 (k and v) in bfloat16.
    assert memory.page_bytes == setup.tokens_per_page * kv * 2 * 2


def test_a_draft_model_row_leaves_the_target_fewer_kv_tokens():
    import argparse

    from benchmarks.plan import _with_draft

    setup = StepSetup(model_config("llama-3.1-8b"), "v6e-1", max_num_seqs=16, max_model_len=2048)
    page = setup.tokens_per_page * 32 * 8 * 128 * 2 * 2  # 32 layers' keys and values
    tokens = 10_000 * setup.tokens_per_page
    row = {"fits": True, "kv_bytes": 10_000 * page, "page_bytes": page, "kv_tokens": tokens}
    args = argparse.Namespace(draft="llama-3.2-1b", dtype="bfloat16", kv_dtype=None, batch=16, context=2048,
                              prefill=512)  # fmt: skip
    draft = _with_draft(dict(row), setup, args)["draft"]
    # 1,235,814,400 parameters (model card) in bfloat16, the tied head's served copy, the RoPE table.
    assert draft["weight_bytes"] == 2 * (1_235_814_400 + 128256 * 2048) + 2048 * 64 * 4
    # 16 layers' keys and values, 8 heads of 64 held in the TPU layout's 128 lanes, bfloat16.
    assert draft["page_bytes"] == setup.tokens_per_page * 16 * 8 * 128 * 2 * 2
    # Its weights first, then a draft page beside every target page.
    assert 0 < draft["num_pages"] == (10_000 * page - draft["weight_bytes"]) // (page + draft["page_bytes"])
    qwen = _with_draft(dict(row), setup, argparse.Namespace(**{**vars(args), "draft": "qwen3-4b"}))["draft"]
    assert "vocabulary" in qwen["error"]
