# SPDX-License-Identifier: Apache-2.0
"""The planner's pure parts, no compiler needed: HLO traffic accounting on a hand-written program,
the KV-cache grouping, the abstract model's bytes and the decode roofline's arithmetic.
(`tests/aot/test_model_step.py` compiles the real programs.)"""

import pytest

from tpu_platform.plan import StepSetup, abstract_model, known_models, kv_layout, model_config
from tpu_platform.plan_hlo import hlo_traffic, shape_bytes
from tpu_platform.plan_kv import decode_roofline, kv_bytes_read, weight_bytes_read

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


def test_kv_layout_groups_sliding_and_full_layers_as_the_engine_does():
    gemma = model_config("gemma-2-9b")  # 42 layers, even ones sliding
    layout = kv_layout(gemma)
    assert (layout.num_groups, layout.num_caches) == (2, 21)
    assert layout.layer_groups[:4] == (0, 1, 0, 1)
    assert layout.layer_caches[:4] == (0, 0, 1, 1) and layout.layer_caches[-1] == 20
    llama = kv_layout(model_config("llama-3.1-8b"))
    assert (llama.layer_groups, llama.num_caches, llama.num_groups) == ((), 32, 1)


def test_known_models_and_errors(tmp_path):
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "gemma-2-9b", "qwen3-30b-a3b"} <= set(known_models())
    with pytest.raises(ValueError, match="neither a known model"):
        model_config(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="unknown compile target"):
        StepSetup(model_config("qwen3-8b"), "v9z-1")


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
