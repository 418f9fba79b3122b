# SPDX-License-Identifier: Apache-2.0
"""4-bit GPTQ checkpoints (packed in `gptq_checkpoints`, the packing checked against vLLM's own
unpacking) load as int4 kernels and compute what the float model of their dequantized weights
does; malformed or unsupported ones are refused at load by name."""

import numpy as np
import pytest

from models import load_model
from tests.models.fp8_checkpoints import write_float
from tests.models.gptq_checkpoints import act_order_g_idx, quantize_gptq, write_gptq
from tests.models.int4_checkpoints import edit_config
from tests.models.tiny_checkpoints import caches, prompts, run_step, save_tiny


def test_packing_is_the_layout_vllm_reads():
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    w = np.random.default_rng(0).normal(size=(24, 64)).astype(np.float32)  # HF [out, in]
    packed = quantize_gptq(w, 16)
    assert packed["qweight"].shape == (8, 24) and packed["qzeros"].shape == (4, 3)
    q = unpack_quantized_values_into_int32(torch.from_numpy(packed["qweight"]), scalar_types.uint4b8, 0)
    zeros = unpack_quantized_values_into_int32(torch.from_numpy(packed["qzeros"]), scalar_types.uint4b8, 1)
    assert (zeros.numpy() == 7).all()  # zero point 8, stored minus one
    scale = np.repeat(packed["scales"].astype(np.float32), 16, axis=0)  # [in, out]
    np.testing.assert_array_equal(((q.numpy() - 8) * scale).T, packed["dequantized"])
    np.testing.assert_allclose(packed["dequantized"], w, atol=np.abs(w).max() / 7.5)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return save_tiny("MistralForCausalLM", str(tmp_path_factory.mktemp("gptq") / "source"))


@pytest.mark.parametrize("group_size", [32, None])
def test_gptq_loads_as_int4_and_computes_the_dequantized_model(mistral, group_size, tmp_path):
    path, dequantized = write_gptq(mistral, str(tmp_path / "gptq"), group_size=group_size)
    write_float(mistral, str(tmp_path / "float"), dequantized)
    config, model = load_model(path)
    _, reference = load_model(str(tmp_path / "float"))
    down = model.model.layers[1].mlp.down_proj
    values = np.asarray(down.kernel[...]).astype(np.int8)
    assert values.min() >= -8 and values.max() <= 7 and values.min() < -4  # 4-bit values, spread
    assert down.kernel_scale[...].shape == ((128 // group_size,) if group_size else ()) + (64,)
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(bits=8), "bits=8"),
        (dict(sym="yes"), "sym=.yes."),
        (dict(checkpoint_format="marlin"), "checkpoint_format .marlin."),
        (dict(lm_head=True), "lm_head=true"),
        (dict(group_size=0), "group_size 0"),
    ],
)
def test_unsupported_gptq_configs_are_refused_by_name(mistral, change, message, tmp_path):
    path, _ = write_gptq(mistral, str(tmp_path / "gptq"), group_size=32)
    edit_config(path, lambda c: c["quantization_config"].update(change))
    with pytest.raises(ValueError, match=message):
        load_model(path)


def _rewrite(path: str, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(f"{path}/model.safetensors")
    edit(tensors)
    save_file(tensors, f"{path}/model.safetensors")


def test_reordered_groups_and_missing_scales_are_refused_by_name(mistral, tmp_path):
    path, _ = write_gptq(mistral, str(tmp_path / "gptq"), group_size=32)
    name = "model.layers.0.mlp.down_proj.g_idx"
    _rewrite(path, lambda t: t.update({name: t[name][::-1].copy()}))
    with pytest.raises(ValueError, match=r"down_proj\.g_idx' reorders .* desc_act false"):
        load_model(path)
    path, _ = write_gptq(mistral, str(tmp_path / "gptq2"), group_size=32)
    _rewrite(path, lambda t: t.pop("model.layers.0.self_attn.o_proj.scales"))
    with pytest.raises(ValueError, match=r"o_proj\.kernel_scale"):
        load_model(path)


def test_act_order_packing_is_the_format_reference():
    """A desc_act layer: vLLM's unpacking of its qweight and qzeros, scaled per input row by the
    group its g_idx names (`(q - z[g_idx]) * s[g_idx]`), is the weight the checkpoint writer
    returns, close to the float one."""
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    w = np.random.default_rng(1).normal(size=(24, 64)).astype(np.float32)
    g_idx = act_order_g_idx(64, 16, seed=3)
    assert not np.array_equal(g_idx, np.arange(64) // 16) and (np.bincount(g_idx) == 16).all()
    packed = quantize_gptq(w, 16, sym=False, g_idx=g_idx)
    np.testing.assert_array_equal(packed["g_idx"], g_idx)
    q = unpack_quantized_values_into_int32(torch.from_numpy(packed["qweight"]), scalar_types.uint4, 0).numpy()
    zeros = unpack_quantized_values_into_int32(torch.from_numpy(packed["qzeros"]), scalar_types.uint4, 1)
    z = zeros.numpy() + 1  # the original format stores zero points minus one
    reference = (q - z[g_idx]) * packed["scales"].astype(np.float32)[g_idx]  # [in, out]
    np.testing.assert_array_equal(reference.T, packed["dequantized"])
    step = packed["scales"].astype(np.float32)[g_idx].T
    assert (np.abs(packed["dequantized"] - w) <= step + 1e-6).all()  # within a step of its own group


# asymmetric: a second load of the same reordered groups, the slow tier's
@pytest.mark.parametrize("sym", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_act_order_loads_and_computes_the_dequantized_model(mistral, sym, tmp_path):
    """desc_act true, every projection's groups a random order of its inputs (o_proj's left
    trivial): the kernels hold int4 values with groups in order and the layers their input
    orders; logits equal the float model of the format's reference dequantization."""
    path, dequantized = write_gptq(mistral, str(tmp_path / "gptq"), group_size=32, sym=sym, act_order=7)
    write_float(mistral, str(tmp_path / "float"), dequantized)
    config, model = load_model(path)
    _, reference = load_model(str(tmp_path / "float"))
    layer = model.model.layers[1]
    assert layer.self_attn.o_proj.input_order is None  # trivial g_idx: no reordering
    for linear in (layer.mlp.down_proj, layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        order = np.asarray(linear.input_order[...])
        assert sorted(order) == list(range(linear.in_features)) and (order != np.arange(order.size)).any()
    assert layer.mlp.down_proj.kernel.get_value().dtype == np.int8  # 4-bit values held as int8 on CPU
    (ids,) = prompts([40], seed=4)
    got, _ = run_step(model, caches(config), [ids], [0], [[1, 2, 3]])
    expected, _ = run_step(reference, caches(config), [ids], [0], [[1, 2, 3]])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)


def test_act_order_that_cannot_be_served_is_refused_by_name(mistral, tmp_path):
    path, _ = write_gptq(mistral, str(tmp_path / "uneven"), group_size=32, act_order=7)
    name = "model.layers.0.mlp.down_proj.g_idx"

    def uneven(t):
        g_idx = t[name].copy()
        g_idx[np.flatnonzero(g_idx == 1)[0]] = 0  # group 0 gets 33 inputs
        t[name] = g_idx

    _rewrite(path, uneven)
    with pytest.raises(ValueError, match=r"down_proj\.g_idx' puts 33 inputs in group 0, not group_size 32"):
        load_model(path)
    path, _ = write_gptq(mistral, str(tmp_path / "differ"), group_size=32, act_order=7)
    k_proj = "model.layers.1.self_attn.k_proj.g_idx"
    _rewrite(path, lambda t: t.update({k_proj: act_order_g_idx(t[k_proj].size, 32, seed=99)}))
    with pytest.raises(
        ValueError, match=r"fused into one \(q/k/v or gate/up\) reorder their inputs differently"
    ):
        load_model(path)
