# SPDX-License-Identifier: Apache-2.0
"""The tensor-parallel rules table and the weight rearrangements it relies on, on NumPy arrays
(the sharded engines themselves: tests/plugin_shim/test_tensor_parallel.py)."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.int8 import quantize_grouped
from models.linear import Linear
from models.registry import build, config_class
from models.sharding import (
    MODEL_AXIS,
    check_model_splits,
    check_tensor_parallel,
    fused_layout,
    interleave_blocks,
    kv_heads_on_mesh,
    parameter_spec,
    repeat_kv_heads,
    rule_spec,
)
from models.weight_stream import served_abstract
from pallas_kernels import kv_cache_partition_spec
from tests.models.tiny_checkpoints import _COMMON, TINY

M = MODEL_AXIS


@pytest.mark.parametrize(
    ("path", "shape", "expected"),
    [
        ("model.layers.0.self_attn.qkv_proj.kernel", (64, 128), P(None, M)),
        ("model.layers.0.self_attn.qkv_proj.bias", (128,), P(M)),
        ("model.layers.3.self_attn.o_proj.kernel", (64, 64), P(M, None)),
        ("model.layers.3.self_attn.o_proj.bias", (64,), P()),
        ("model.layers.1.mlp.gate_up_proj.kernel", (64, 256), P(None, M)),
        ("model.layers.1.mlp.down_proj.kernel", (128, 64), P(M, None)),
        ("model.layers.1.mlp.experts.gate_proj.kernel", (8, 64, 32), P(None, None, M)),
        ("model.layers.1.mlp.experts.down_proj.kernel", (8, 32, 64), P(None, M, None)),
        ("model.layers.1.mlp.router.kernel", (64, 8), P()),
        ("model.embed_tokens.embedding", (384, 64), P(M, None)),
        ("model.embed_tokens.head_kernel", (64, 384), P(None, M)),
        ("lm_head.kernel", (64, 384), P(None, M)),
        ("model.layers.0.input_layernorm.weight", (64,), P()),
        ("model.layers.0.self_attn.rope_table.value", (512, 16), P()),
        ("model.embed_tokens.embedding", (385, 64), P()),  # a vocabulary 4 does not divide
        # LoRA slots `a [S, in, P * R]`, `b [S, P * R, out]`: split like their projection
        ("model.layers.0.self_attn.qkv_proj.lora.a", (3, 64, 24), P()),
        ("model.layers.0.self_attn.qkv_proj.lora.b", (3, 24, 128), P(None, None, M)),
        ("model.layers.1.mlp.gate_up_proj.lora.b", (3, 16, 256), P(None, None, M)),
        ("model.layers.3.self_attn.o_proj.lora.a", (3, 64, 8), P(None, M, None)),
        ("model.layers.3.self_attn.o_proj.lora.b", (3, 8, 64), P()),
        ("model.layers.1.mlp.down_proj.lora.a", (3, 128, 8), P(None, M, None)),
        ("model.layers.1.mlp.down_proj.lora.b", (3, 8, 64), P()),
        # int8 kernels' per-output-channel scales: split with their kernel's columns
        ("model.layers.0.self_attn.qkv_proj.kernel_scale", (128,), P(M)),
        ("model.layers.1.mlp.gate_up_proj.kernel_scale", (256,), P(M)),
        ("model.layers.3.self_attn.o_proj.kernel_scale", (64,), P()),
        ("model.layers.1.mlp.down_proj.kernel_scale", (64,), P()),
        ("model.layers.1.mlp.experts.gate_proj.kernel_scale", (8, 32), P(None, M)),
        ("model.layers.1.mlp.experts.up_proj.kernel_scale", (8, 32), P(None, M)),
        ("model.layers.1.mlp.experts.down_proj.kernel_scale", (8, 64), P()),
        ("model.embed_tokens.head_scale", (384,), P(M)),
        ("lm_head.kernel_scale", (384,), P(M)),
        ("lm_head.kernel_scale", (385,), P()),
        # grouped int8 scales `[in / G, out]`: column-parallel split on out, row-parallel on groups
        ("model.layers.0.self_attn.qkv_proj.kernel_scale", (2, 128), P(None, M)),
        ("model.layers.1.mlp.gate_up_proj.kernel_scale", (2, 256), P(None, M)),
        ("model.layers.3.self_attn.o_proj.kernel_scale", (4, 64), P(M, None)),
        ("model.layers.1.mlp.down_proj.kernel_scale", (8, 64), P(M, None)),
        ("model.embed_tokens.head_scale", (2, 384), P(None, M)),
        ("lm_head.kernel_scale", (2, 384), P(None, M)),
        ("lm_head.kernel_scale", (2, 385), P()),
    ],
)
def test_parameter_spec_follows_the_table_and_divisibility(path, shape, expected):
    assert parameter_spec(path, shape, 4) == expected
    assert parameter_spec(path, shape, 1) == P()


def test_a_row_parallel_grouped_scale_refuses_a_tp_size_ending_inside_a_group():
    # o_proj of 64 inputs in 2 groups of 32: 4 devices would hold 16 inputs each.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot split .*o_proj.kernel_scale"):
        parameter_spec("model.layers.3.self_attn.o_proj.kernel_scale", (2, 64), 4)
    assert parameter_spec("model.layers.3.self_attn.o_proj.kernel_scale", (2, 64), 2) == P(M, None)


def test_kv_heads_split_or_repeat_and_impossible_sizes_name_the_working_ones():
    assert kv_heads_on_mesh(32, 8, 4) == 8  # split
    assert kv_heads_on_mesh(32, 8, 8) == 8
    assert kv_heads_on_mesh(8, 2, 8) == 8  # each head on 4 devices
    assert kv_heads_on_mesh(4, 1, 4) == 4
    with pytest.raises(ValueError, match=r"4 query heads do not divide by 8; .* one of \[1, 2, 4\]"):
        check_tensor_parallel(4, 2, 8)
    with pytest.raises(ValueError, match=r"3 KV heads neither divide by 2 nor divide it"):
        check_tensor_parallel(6, 3, 2)


def test_repeat_kv_heads_copies_each_head_in_place():
    heads, head_dim = 2, 3
    kernel = np.arange(4 * heads * head_dim).reshape(4, heads * head_dim)
    repeated = repeat_kv_heads(kernel, heads, 2, axis=1)
    head = [kernel[:, h * head_dim : (h + 1) * head_dim] for h in range(heads)]
    np.testing.assert_array_equal(repeated, np.concatenate([head[0], head[0], head[1], head[1]], axis=1))
    bias = np.arange(heads * head_dim)
    np.testing.assert_array_equal(
        repeat_kv_heads(bias, heads, 3, axis=0), np.repeat(bias.reshape(2, 1, 3), 3, 1).ravel()
    )


def test_fused_kernel_blocks_give_each_device_its_slice_of_every_part():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((5, width)).astype(np.float32) for width in (8, 4, 4)]  # q, k, v
    fused = interleave_blocks(parts, 2, axis=1)
    for device, block in enumerate(np.split(fused, 2, axis=1)):
        expected = np.concatenate([np.split(p, 2, axis=1)[device] for p in parts], axis=1)
        np.testing.assert_array_equal(block, expected)
    np.testing.assert_array_equal(interleave_blocks(parts, 1, axis=1), np.concatenate(parts, axis=1))


def test_fused_linear_in_blocks_computes_the_parts_outputs():
    x = np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)
    parts = []
    for seed in (2, 3):
        linear = Linear(6, 8, bias=True, dtype=np.float32)
        rng = np.random.default_rng(seed)
        linear.kernel.set_value(rng.standard_normal((6, 8)).astype(np.float32))
        linear.bias.set_value(rng.standard_normal(8).astype(np.float32))
        parts.append(linear)
    fused = Linear.concatenated(parts, blocks=4)
    y = np.asarray(fused(x)).reshape(3, 4, 2, 2)  # [T, device, part, columns]
    for i, part in enumerate(parts):
        np.testing.assert_allclose(y[:, :, i].reshape(3, 8), np.asarray(part(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("xla", P(M)), ("cpu_native", P(None, M)), ("pallas_tpu", P(None, M)), ("pallas_gpu", P(None, M))],
)
def test_each_cache_layout_splits_on_its_kv_head_axis(backend, expected):
    assert kv_cache_partition_spec(backend, M) == expected


@pytest.fixture(scope="module")
def prepared_at_each_tp(tmp_path_factory):
    """A tiny Llama (8 query, 2 KV heads) prepared on the host for TP 1, 2, 4 and 8."""
    from flax import nnx

    from models import load_model
    from tests.tiny_models import save_tiny_llama

    path = save_tiny_llama(
        str(tmp_path_factory.mktemp("llama")), hidden_size=64, num_attention_heads=8, num_key_value_heads=2
    )
    prepared = {}
    for tp in (1, 2, 4, 8):
        config, model = load_model(path, on_host=True, tp_size=tp)
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        prepared[tp] = {".".join(map(str, key)): np.asarray(var.get_value()) for key, var in flat}
    return config, prepared


def test_prepared_weights_convert_between_tp_sizes(prepared_at_each_tp):
    config, prepared = prepared_at_each_tp
    heads = dict(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    assert prepared[8]["model.layers.0.self_attn.qkv_proj.kernel"].shape[1] == (8 + 2 * 8) * config.head_dim
    for source in prepared:
        for target in prepared:
            for path, value in prepared[source].items():
                converted = fused_layout(path, value, from_tp=source, to_tp=target, **heads)
                np.testing.assert_array_equal(
                    converted, prepared[target][path], err_msg=f"{path} {source}->{target}"
                )


def test_grouped_scales_convert_between_tp_sizes_like_their_kernels(prepared_at_each_tp):
    """A fused kernel's grouped int8 scales re-blocked between TP sizes (KV heads repeated or not)
    are those of the kernel prepared at the target size: quantizing in groups commutes with it."""
    config, prepared = prepared_at_each_tp
    heads = dict(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    fused = [p for p in prepared[1] if p.endswith(("qkv_proj.kernel", "gate_up_proj.kernel"))]
    for source, target in [(1, 8), (8, 2), (4, 1)]:
        for path in fused:
            _, scale = quantize_grouped(prepared[source][path], 16)
            converted = fused_layout(f"{path}_scale", scale, from_tp=source, to_tp=target, **heads)
            np.testing.assert_array_equal(
                converted, quantize_grouped(prepared[target][path], 16)[1], err_msg=path
            )


@functools.cache
def _tiny_config(architecture: str, **overrides) -> ModelConfig:
    """The tiny test checkpoint's configuration of `architecture` (no weights), with `overrides`
    (`moe_intermediate_size` only where the architecture has that field: Mixtral's experts are
    `intermediate_size` wide)."""
    import transformers

    config_name, arch_kwargs = TINY[architecture]
    if architecture != "Qwen3MoeForCausalLM":
        overrides.pop("moe_intermediate_size", None)
    hf = getattr(transformers, config_name)(**{**_COMMON, **arch_kwargs, **overrides}).to_dict()
    return config_class(architecture).from_hf_dict({**hf, "architectures": [architecture]})


@functools.cache
def _rules_split(config: ModelConfig, tp: int) -> bool:
    """Whether the model prepares for `tp` devices and every parameter the rules table splits
    (but the vocabulary's, replicated when it does not divide) splits evenly there."""
    try:
        _, state = served_abstract(nnx.eval_shape(lambda: build(config)), config, tp)
    except ValueError:  # the fused q/k/v or gate/up blocks, or the KV heads, cannot be made
        return False
    for key, leaf in nnx.to_flat_state(state):
        path = ".".join(map(str, key))
        if re.search(r"embed_tokens|lm_head", path):
            continue
        spec = rule_spec(path, len(leaf.shape))
        if any(name is not None and leaf.shape[axis] % tp for axis, name in enumerate(spec)):
            return False
    return True


# 12 query and 4 KV heads (TP 2, 3, 4, 6, 12 split them; 8 does not); intermediate sizes that
# 3, 6 and 12, or 3, 8 and 12, do not divide, each in turn (a MoE model's dense layers and its experts).
_VARIANTS = (
    dict(
        hidden_size=96,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=320,
        moe_intermediate_size=48,
    ),
    dict(
        hidden_size=96,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=384,
        moe_intermediate_size=20,
    ),
)
_SIZES = (1, 2, 3, 4, 6, 8, 12)
_FAST = ("Qwen2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")  # dense, experts, both


@pytest.mark.parametrize(
    "architecture", [a if a in _FAST else pytest.param(a, marks=pytest.mark.slow) for a in sorted(TINY)]
)
def test_the_start_check_covers_every_dimension_the_rules_table_splits(architecture):
    """`check_model_splits` accepts a TP size exactly when the model prepares for it and every
    parameter the rules table splits divides evenly; a refusal names the sizes that work."""
    for overrides in _VARIANTS:
        config = _tiny_config(architecture, **overrides)
        for tp in _SIZES[1:]:
            try:
                check_model_splits(config, tp)
                accepted = True
            except ValueError as error:
                accepted = False
                message = str(error)
                assert message.startswith(f"tensor_parallel_size={tp} cannot shard this model: its "), message
                listed = [int(n) for n in re.search(r"one of \[(.*)\]$", message).group(1).split(", ")]
                assert [n for n in _SIZES if n in listed] == [n for n in _SIZES if _rules_split(config, n)]
            assert accepted == _rules_split(config, tp), (architecture, overrides, tp)


def test_an_intermediate_size_that_does_not_divide_is_named():
    config = _tiny_config(
        "Qwen2ForCausalLM",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=320,
    )
    with pytest.raises(
        ValueError, match=r"its intermediate_size \(320\) does not divide by 6; .* one of \[1, 2\]$"
    ):
        check_model_splits(config, 6)
    moe = _tiny_config("Qwen3MoeForCausalLM", moe_intermediate_size=18)
    with pytest.raises(
        ValueError, match=r"its experts' intermediate size \(18\) does not divide by 4; .* \[1, 2\]$"
    ):
        check_model_splits(moe, 4)
    mixtral = _tiny_config("MixtralForCausalLM", intermediate_size=18)
    with pytest.raises(
        ValueError, match=r"its experts' intermediate size \(18\) does not divide by 4; .* \[1, 2\]$"
    ):
        check_model_splits(mixtral, 4)


@pytest.mark.parametrize(
    "path",
    [
        "model.layers.0.mlp.experts.gate_proj.kernel",  # [E, D, F]
        "model.layers.0.mlp.experts.down_proj.kernel",  # [E, F, D]
        "model.layers.0.mlp.experts.up_proj.kernel_scale",  # [E, F] per channel
        "model.layers.0.mlp.experts.gate_up_proj_bias",  # GPT-OSS [E, 2F]
    ],
)
def test_expert_parallel_splits_every_expert_array_on_its_expert_axis(path):
    shape = (8, 12, 6)[: 2 if path.endswith(("scale", "bias")) else 3]
    assert parameter_spec(path, shape, 4) != P(MODEL_AXIS)  # split inside each expert, or whole
    assert parameter_spec(path, shape, 4, expert_parallel=True) == P(MODEL_AXIS)
    assert parameter_spec(path, shape, 1, expert_parallel=True) == P()


@pytest.mark.parametrize(
    ("path", "shape", "expected"),
    [
        ("model.layers.0.mlp.router.kernel", (64, 8), P()),
        ("model.layers.0.mlp.shared_experts.gate_proj.kernel", (64, 32), P(None, MODEL_AXIS)),
        ("model.layers.0.mlp.shared_expert.down_proj.kernel", (32, 64), P(MODEL_AXIS, None)),
        ("model.layers.0.self_attn.qkv_proj.kernel", (64, 128), P(None, MODEL_AXIS)),
    ],
)
def test_expert_parallel_leaves_router_shared_experts_and_attention_to_the_table(path, shape, expected):
    assert parameter_spec(path, shape, 4, expert_parallel=True) == expected


def test_expert_parallel_refuses_an_expert_count_that_does_not_split_and_frees_their_size():
    with pytest.raises(ValueError, match=r"cannot split this model's 8 experts by index: .* \[1, 2, 4, 8\]"):
        parameter_spec("model.layers.0.mlp.experts.gate_proj.kernel", (8, 12, 6), 3, expert_parallel=True)
    moe = _tiny_config("Qwen3MoeForCausalLM", moe_intermediate_size=18)  # 8 experts of 18
    check_model_splits(moe, 4, expert_parallel=True)  # whole experts: their size need not divide
    with pytest.raises(ValueError, match="its experts' intermediate size"):
        check_model_splits(moe, 4)
    with pytest.raises(ValueError, match="cannot split this model's 8 experts by index"):
        check_model_splits(
            _tiny_config("Qwen3MoeForCausalLM", num_attention_heads=16), 16, expert_parallel=True
        )


def _qwen3_next_config(**overrides) -> ModelConfig:
    from tests.models.tiny_qwen3_next import FIELDS

    return ModelConfig.from_hf_dict({**FIELDS, **overrides, "architectures": ["Qwen3NextForCausalLM"]})


@pytest.mark.parametrize(
    ("path", "shape", "expected"),
    [  # a Gated DeltaNet layer of 2 key heads of 16 and 4 value heads of 8, at TP=2
        ("model.layers.0.linear_attn.in_proj_qkvz.kernel", (64, 128), P(None, M)),
        ("model.layers.0.linear_attn.in_proj_ba.kernel", (64, 8), P(None, M)),
        ("model.layers.0.linear_attn.in_proj_q.kernel", (64, 32), P(None, M)),
        ("model.layers.0.linear_attn.in_proj_v.kernel", (64, 32), P(None, M)),
        ("model.layers.0.linear_attn.in_proj_b.kernel", (64, 4), P(None, M)),
        ("model.layers.0.linear_attn.out_proj.kernel", (32, 64), P(M, None)),
        ("model.layers.0.linear_attn.A_log", (4,), P(M)),
        ("model.layers.0.linear_attn.dt_bias", (4,), P(M)),
        ("model.layers.0.linear_attn.conv1d.weight", (96, 1, 4), P()),  # whole: each device slices it
        ("model.layers.0.linear_attn.norm.weight", (8,), P()),
        ("model.layers.0.mlp.shared_expert_gate.kernel", (64, 1), P()),
    ],
)
def test_gated_deltanet_splits_by_heads(path, shape, expected):
    assert parameter_spec(path, shape, 2) == expected


def test_a_hybrid_splits_whole_key_heads_and_its_shared_expert_or_names_them():
    check_model_splits(_qwen3_next_config(), 2)
    with pytest.raises(
        ValueError, match=r"its linear_num_key_heads \(2\) does not divide by 4; .* one of \[1, 2\]$"
    ):
        check_model_splits(_qwen3_next_config(), 4)
    check_model_splits(_qwen3_next_config(linear_num_key_heads=4, linear_num_value_heads=8), 4)
    config = _qwen3_next_config(linear_num_key_heads=4, linear_num_value_heads=8)
    odd_shared_expert = dataclasses.replace(config, shared_expert_intermediate_size=42)
    with pytest.raises(ValueError, match=r"shared expert's intermediate size \(42\) does not divide by 4"):
        check_model_splits(odd_shared_expert, 4)


def test_gated_attention_fused_blocks_convert_between_tp_sizes(tmp_path):
    """Qwen3-Next's fused q (with its gates), k and v, prepared at 1 and 2 devices, re-blocked from
    one to the other as a restore at another TP size does (`fused_layout`: q twice as wide)."""
    from flax import nnx

    from models import load_model
    from tests.models.tiny_qwen3_next import save_tiny_qwen3_next

    path = save_tiny_qwen3_next(str(tmp_path / "model"))
    prepared = {}
    for tp in (1, 2):
        config, model = load_model(path, on_host=True, tp_size=tp)
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        prepared[tp] = {".".join(map(str, key)): np.asarray(var.get_value()) for key, var in flat}
    heads = dict(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    name = "model.layers.3.self_attn.qkv_proj.kernel"
    assert not np.array_equal(prepared[1][name], prepared[2][name])  # the blocks differ
    for source, target in [(1, 2), (2, 1)]:
        for path_, value in prepared[source].items():
            converted = fused_layout(path_, value, from_tp=source, to_tp=target, **heads)
            np.testing.assert_array_equal(converted, prepared[target][path_], err_msg=path_)
