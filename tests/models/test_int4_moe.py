# SPDX-License-Identifier: Apache-2.0
"""MoE experts with zero points (affine 4-bit, `models.int4`: `w = q * s + m`): tiny Qwen3-MoE
and Mixtral checkpoints in AWQ (hand-packed as AutoAWQ writes them, `awq_checkpoints`),
asymmetric GPTQ (`gptq_checkpoints`) and compressed-tensors `symmetric: false` (the package's
own qparams, quantization and packing, `int4_checkpoints`) load each expert's 4-bit values,
scales and offsets stacked, and the routed experts compute what the float model of the format's
dequantized weights does; the offsets split like their scales on a mesh. GPTQ activation order
(`desc_act`: every expert its own random group order of its inputs, `models.gptq_expert_orders`)
loads into the same stacks with each expert's gate/up order beside them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from models import int4, load_model
from models.moe import experts_routed, route
from models.sharding import MODEL_AXIS, parameter_spec
from tests.models.awq_checkpoints import write_awq
from tests.models.fp8_checkpoints import write_float
from tests.models.gptq_checkpoints import act_order_g_idx, write_gptq
from tests.models.int4_checkpoints import write_packed_w4a16
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return save_tiny("Qwen3MoeForCausalLM", str(tmp_path_factory.mktemp("int4_moe") / "source"))


def _assert_experts_compute_the_dequantized_model(path: str, float_path: str, group_size: int | None):
    """The loaded model and the float one of the dequantized weights, once checked."""
    config, model = load_model(path)
    _, reference = load_model(float_path)
    mlp = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    experts = mlp.experts
    for stack in (experts.gate_proj, experts.up_proj, experts.down_proj):
        num_experts, inputs, outputs = stack.kernel[...].shape
        assert stack.kernel[...].dtype == int4.held_dtype()
        want = (num_experts, *((inputs // group_size,) if group_size else ()), outputs)
        assert stack.kernel_scale[...].shape == stack.kernel_offset[...].shape == want
        assert np.abs(np.asarray(stack.kernel_offset[...])).max() > 0  # zero points that matter
    assert mlp.router.kernel_scale is None and mlp.router.kernel_offset is None
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)
    return model, reference


def test_awq_moe_experts_load_with_zero_points(qwen3_moe, tmp_path):
    """Qwen3-30B-A3B-AWQ's layout: every expert's qweight, qzeros and scales (groups of 16 of
    the experts' 64 and 32 inputs)."""
    path, dequantized = write_awq(qwen3_moe, str(tmp_path / "awq"), group_size=16)
    float_path = write_float(qwen3_moe, str(tmp_path / "float"), dequantized)
    _assert_experts_compute_the_dequantized_model(path, float_path, 16)


@pytest.mark.slow  # a second architecture's load of the same routed path
def test_mixtral_awq_experts_load_with_zero_points(tmp_path):
    source = save_tiny("MixtralForCausalLM", str(tmp_path / "source"), num_hidden_layers=1)
    path, dequantized = write_awq(source, str(tmp_path / "awq"), group_size=32)
    float_path = write_float(source, str(tmp_path / "float"), dequantized)
    _assert_experts_compute_the_dequantized_model(path, float_path, 32)


# Grouped: its path runs in `make test` through the act-order test below, orders aside.
@pytest.mark.parametrize(
    "group_size", [pytest.param(16, marks=pytest.mark.full), pytest.param(None, marks=pytest.mark.slow)]
)  # None: per channel
def test_asymmetric_gptq_moe_experts_load_with_zero_points(qwen3_moe, group_size, tmp_path):
    path, dequantized = write_gptq(qwen3_moe, str(tmp_path / "gptq"), group_size=group_size, sym=False)
    float_path = write_float(qwen3_moe, str(tmp_path / "float"), dequantized)
    _assert_experts_compute_the_dequantized_model(path, float_path, group_size)


@pytest.mark.slow  # a third load of the routed experts (fast: AWQ's, compressed-tensors')
def test_act_order_gptq_moe_experts_load_each_in_its_own_order(qwen3_moe, tmp_path):
    """Asymmetric GPTQ with desc_act, every expert's gate/up rows and down rows reordered (groups
    of 16 of 64 and 32 inputs): the gate stack holds each expert's own order, down none (gate's
    and up's outputs, zero points included, arrive in its order); the served logits and the
    dense reference equal the float model's."""
    path, dequantized = write_gptq(qwen3_moe, str(tmp_path / "gptq"), group_size=16, sym=False, act_order=7)
    float_path = write_float(qwen3_moe, str(tmp_path / "float"), dequantized)
    model, reference = _assert_experts_compute_the_dequantized_model(path, float_path, 16)
    mlp = model.model.layers[0].mlp
    order = np.asarray(mlp.experts.gate_proj.input_order[...])
    assert order.shape == (8, 64) and (np.sort(order, axis=1) == np.arange(64)).all()
    assert len({row.tobytes() for row in order}) == 8  # each expert its own order
    assert mlp.experts.up_proj.input_order is None and mlp.experts.down_proj.input_order is None
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 64)), jnp.float32)
    want = jax.jit(lambda x: reference.model.layers[0].mlp(x, dense=True))(x)
    np.testing.assert_allclose(jax.jit(lambda x: mlp(x, dense=True))(x), want, atol=2e-4, rtol=2e-4)


def test_an_expert_whose_gate_and_up_orders_differ_is_refused_by_name(qwen3_moe, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = write_gptq(qwen3_moe, str(tmp_path / "gptq"), group_size=16, act_order=7)
    tensors = load_file(f"{path}/model.safetensors")
    up = "model.layers.2.mlp.experts.5.up_proj.g_idx"
    tensors[up] = act_order_g_idx(64, 16, seed=99)
    save_file(tensors, f"{path}/model.safetensors")
    message = r"experts\.5\.gate_proj\.g_idx and \S+experts\.5\.up_proj\.g_idx order"
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_compressed_tensors_asymmetric_moe_experts_load_with_zero_points(qwen3_moe, tmp_path):
    path, dequantized = write_packed_w4a16(qwen3_moe, str(tmp_path / "w4a16"), group_size=16, symmetric=False)
    float_path = write_float(qwen3_moe, str(tmp_path / "float"), dequantized)
    _assert_experts_compute_the_dequantized_model(path, float_path, 16)


# bfloat16: the same program in another dtype, the slow tier's
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_routed_affine_experts_equal_the_dense_reference(dtype):
    """The routed tiles' offset products (per group and per channel) against every expert run
    on the dequantized weights `q * s + m`; in bfloat16 too (XLA:CPU has no bfloat16 dot batched
    over tiles and groups: each tile's kernel is dequantized there)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(9, 32)), dtype)
    weights, experts = route(jnp.asarray(rng.normal(size=(9, 4)), jnp.float32), 2, renormalize=True)
    for groups in (None, 2):
        stacks, scales, offsets, dense = [], [], [], []
        for inputs, outputs in ((32, 16), (32, 16), (16, 32)):
            q = rng.integers(-8, 8, size=(4, inputs, outputs)).astype(np.int8)
            shape = (4, outputs) if groups is None else (4, groups, outputs)
            s = rng.uniform(0.01, 0.1, size=shape).astype(np.float32)
            m = rng.uniform(-0.3, 0.3, size=shape).astype(np.float32)
            stacks.append(jnp.asarray(q))
            scales.append(jnp.asarray(s))
            offsets.append(jnp.asarray(m))
            dense.append(jnp.asarray(int4.dequantize_affine(q, s, m), dtype))
        got = experts_routed(
            x, *stacks, weights, experts, jnp.tanh, scales=tuple(scales), offsets=tuple(offsets)
        )
        want = np.asarray(experts_routed(x, *dense, weights, experts, jnp.tanh), np.float32)
        tolerance = 1e-4 if dtype == jnp.float32 else 2e-2 * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-4, atol=tolerance)


def test_expert_offsets_split_like_their_scales_and_a_cut_group_is_refused_by_name():
    """gate/up offsets on their outputs (F), down's on its groups of F inputs; a TP size that
    would end a device's share of down's inputs inside a group is refused, naming the tensor."""
    gate = "model.layers.0.mlp.experts.gate_proj.kernel_offset"
    down = "model.layers.0.mlp.experts.down_proj.kernel_offset"
    assert parameter_spec(gate, (8, 4, 32), 2) == PartitionSpec(None, None, MODEL_AXIS)
    assert parameter_spec(down, (8, 2, 64), 2) == PartitionSpec(None, MODEL_AXIS, None)
    assert parameter_spec(gate, (8, 32), 2) == PartitionSpec(None, MODEL_AXIS)  # per channel
    assert parameter_spec(down, (8, 64), 2) == PartitionSpec()
    assert parameter_spec(down, (8, 2, 64), 2, expert_parallel=True) == PartitionSpec(MODEL_AXIS)
    with pytest.raises(
        ValueError, match=r"cannot split model\.layers\.0\.mlp\.experts\.down_proj\.kernel_offset"
    ):
        parameter_spec(down, (8, 2, 64), 4)
