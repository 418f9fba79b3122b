# SPDX-License-Identifier: Apache-2.0
"""Qwen3.5 checkpoints quantized as they ship: `quant_method: fp8` in 128x128 blocks (Qwen's own
Qwen3.5-*-FP8, `in_proj_b` / `in_proj_a` left in float), GPTQ, AWQ and compressed-tensors W4A16.
The fused `linear_attn.in_proj_qkv` is cut into q, k and v in each tensor's own layout
(`models.fused_outputs`); the model computes transformers' logits and greedy tokens on the
dequantized weights. The cut itself is checked against NumPy on every format's tensors, and a
q/k/v width that is not a whole number of fp8 blocks is refused by name."""

from __future__ import annotations

import re

import numpy as np
import pytest

from models import fp8, int4, load_model
from models.fused_outputs import FusedOutputs, OutputUnits, output_units, split_tensor
from models.linear import kept_float
from tests.models.fp8_checkpoints import dequantized_weights, write_block_fp8, write_float
from tests.models.test_qwen3_next import ATOL, _caches
from tests.models.tiny_checkpoints import RTOL, hf_logits, prompts, run_step
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next

DENSE, MOE = "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"
# Whole 128-wide fp8 blocks: q and k 2 x 64, v 4 x 32 outputs of in_proj_qkv; 128 hidden inputs.
FP8_WIDTHS = dict(
    hidden_size=128, linear_key_head_dim=64, linear_value_head_dim=32, head_dim=32, intermediate_size=256
)
# What Qwen's FP8 release and the community recipes leave in float beside the head and router:
# the per-head b and a projections (a handful of outputs, too few for packed 4-bit words).
BA = re.compile(r"linear_attn\.in_proj_[ba]\.weight$")
QKV = FusedOutputs(".qkv", (".q", ".k", ".v"), (16, 16, 32))


def _reference(architecture: str, source: str, out: str, dequantized: dict[str, np.ndarray]):
    import torch
    import transformers

    path = write_float(source, out, dequantized)
    return getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()


def _assert_computes(model, config, hf, steps: int = 4) -> None:
    """The prefill's logits at every position close to transformers', and `steps` greedy tokens
    (one prefill, then decodes carrying the states) equal to transformers' `generate`."""
    import torch

    (ids,) = prompts([24], seed=24)
    kv, pages = _caches(config, model, 8), [[3, 1]]  # the state's slot: page 3
    logits, kv = run_step(model, kv, [ids], [0], pages)
    np.testing.assert_allclose(logits, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)
    tokens = [int(np.argmax(logits[-1]))]
    for i in range(steps - 1):
        logits, kv = run_step(model, kv, [[tokens[-1]]], [len(ids) + i], pages)
        tokens.append(int(np.argmax(logits[-1])))
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    expected = expected[0, len(ids) :].tolist()  # up to its end-of-sequence token, if it comes
    assert expected and tokens[: len(expected)] == expected


@pytest.mark.slow  # a load and a step of fp8 programs of its own (fast fp8 loads: test_fp8.py)
def test_block_fp8_qwen3_5_as_qwen_ships_it(tmp_path):
    source = save_tiny_qwen3_next(str(tmp_path / "source"), architecture=DENSE, **FP8_WIDTHS)
    ignored = tuple(f"model.layers.{i}.linear_attn.in_proj_{p}" for i in range(3) for p in "ba")
    path = write_block_fp8(source, str(tmp_path / "fp8"), ignored=ignored)
    config, model = load_model(path)
    mixer = model.model.layers[0].linear_attn
    for name in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj"):
        projection = getattr(mixer, name)
        assert projection.kernel[...].dtype == fp8.FP8_DTYPE, name
        assert projection.kernel_scale[...].shape == (1, projection.kernel.shape[1])  # [in / 128, out]
    assert mixer.in_proj_b.kernel[...].dtype == np.float32 and kept_float(mixer.in_proj_b)
    assert model.model.layers[3].self_attn.qkv_proj.kernel[...].dtype == fp8.FP8_DTYPE
    hf = _reference(DENSE, source, str(tmp_path / "float"), dequantized_weights(path))
    _assert_computes(model, config, hf)


def test_a_qkv_width_inside_an_fp8_block_is_refused_by_name(tmp_path):
    # q and k 2 x 32 outputs: the 128-row scale blocks of in_proj_qkv straddle q, k and v.
    widths = {**FP8_WIDTHS, "linear_key_head_dim": 32}
    source = save_tiny_qwen3_next(str(tmp_path / "source"), architecture=DENSE, **widths)
    path = write_block_fp8(source, str(tmp_path / "fp8"))
    message = (
        r"'model\.layers\.0\.linear_attn\.in_proj_qkv\.weight_scale_inv'.*\[64, 64, 128\].*multiples of 128"
    )
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_a_missing_scale_of_a_fused_layer_names_the_checkpoints_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    source = save_tiny_qwen3_next(str(tmp_path / "source"), architecture=DENSE, **FP8_WIDTHS)
    path = write_block_fp8(source, str(tmp_path / "fp8"))
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"]
    save_file(tensors, file, metadata={"format": "pt"})
    # the part's name is what the format's reader sees; the checkpoint holds only the fused layer
    message = (
        r"'model\.layers\.0\.linear_attn\.in_proj_q\.weight' .* without a scale.*"
        r"in_proj_q\.weight is cut from the checkpoint's model\.layers\.0\.linear_attn\.in_proj_qkv\.weight\b"
    )
    with pytest.raises(ValueError, match=message):
        load_model(path)


def _gptq(source: str, out: str):
    from tests.models.gptq_checkpoints import write_gptq

    # asymmetric with activation order: qzeros cut by words, each part reordered by the g_idx
    return write_gptq(source, out, group_size=32, sym=False, act_order=5, keep_float=BA)


def _awq(source: str, out: str):
    from tests.models.awq_checkpoints import write_awq

    return write_awq(source, out, group_size=32, keep_float=BA)


def _w4a16(source: str, out: str):
    from tests.models.int4_checkpoints import write_packed_w4a16

    return write_packed_w4a16(source, out, group_size=16, symmetric=False)


_WRITERS = {"gptq": _gptq, "awq": _awq, "w4a16": _w4a16}


@pytest.mark.parametrize(
    ("kind", "architecture"),
    [
        # compressed-tensors' packed zero points: eight outputs a word on axis 0
        pytest.param("w4a16", DENSE, marks=pytest.mark.slow),
        pytest.param("gptq", DENSE, marks=pytest.mark.full),
        pytest.param("awq", DENSE, marks=pytest.mark.full),
        pytest.param("gptq", MOE, marks=pytest.mark.full),  # experts, shared expert too
    ],
)
def test_4bit_qwen3_5_computes_its_dequantized_model(kind, architecture, tmp_path):
    overrides = (
        {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64} if architecture == MOE else {}
    )
    source = save_tiny_qwen3_next(str(tmp_path / "source"), architecture=architecture, **overrides)
    path, dequantized = _WRITERS[kind](source, str(tmp_path / kind))
    config, model = load_model(path)
    mixer = model.model.layers[0].linear_attn
    for name in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj"):
        assert getattr(mixer, name).kernel[...].dtype == int4.held_dtype(), name
    assert model.model.layers[3].self_attn.qkv_proj.kernel[...].dtype == int4.held_dtype()  # q with its gate
    if architecture == MOE:
        mlp = model.model.layers[0].mlp
        assert mlp.experts.gate_proj.kernel[...].dtype == int4.held_dtype()
        assert mlp.shared_expert.down_proj.kernel[...].dtype == int4.held_dtype()
        assert mlp.router.kernel_scale is None and mlp.shared_expert_gate.kernel_scale is None
    hf = _reference(architecture, source, str(tmp_path / "float"), dequantized)
    _assert_computes(model, config, hf)


def test_a_quantized_mtp_layer_is_left_to_the_mtp_head(tmp_path):
    """The target's load leaves the quantized `mtp.*` tensors unread (they once reached the
    layout's kernel set-up and were refused as matching no layer); the MTP head reads them 4-bit."""
    import jax.numpy as jnp

    from models.qwen3_next_mtp import load_qwen_mtp_head
    from tests.models.gptq_checkpoints import write_gptq
    from tests.models.tiny_qwen3_next import save_tiny_qwen3_next_mtp

    source = save_tiny_qwen3_next_mtp(str(tmp_path / "source"), architecture=DENSE)
    path, _ = write_gptq(source, str(tmp_path / "gptq"), group_size=32, keep_float=BA)
    config, model = load_model(path)
    assert model.model.layers[0].linear_attn.in_proj_q.kernel[...].dtype == int4.held_dtype()
    head = load_qwen_mtp_head(path, config, jnp.float32)
    assert head.block.mlp.down_proj.kernel[...].dtype == int4.held_dtype()


def _parts(array, units, kind="weight"):
    return [a for _, a in split_tensor(f"x.qkv.{kind}", array, QKV, units)]


def test_each_format_cuts_its_own_output_axis_in_its_own_units():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 24)).astype(np.float32)  # [out, in]: q 16, k 16, v 32 outputs
    q, k, v = _parts(w, OutputUnits())
    np.testing.assert_array_equal(np.concatenate([q, k, v]), w)
    assert [p.shape[0] for p in (q, k, v)] == [16, 16, 32]
    gptq, awq = output_units({"quant_method": "gptq"}), output_units({"quant_method": "awq"})
    qweight = rng.integers(0, 2**31, size=(3, 64), dtype=np.int32)  # GPTQ `[in / 8, out]`
    assert [p.shape for p in _parts(qweight, gptq, "qweight")] == [(3, 16), (3, 16), (3, 32)]
    words = rng.integers(0, 2**31, size=(24, 8), dtype=np.int32)  # AWQ `[in, out / 8]`
    parts = _parts(words, awq, "qweight")
    assert [p.shape for p in parts] == [(24, 2), (24, 2), (24, 4)]
    np.testing.assert_array_equal(parts[2], words[:, 4:])
    assert [p.shape for p in _parts(words[:2], gptq, "qzeros")] == [(2, 2), (2, 2), (2, 4)]
    assert all(p is w for p in _parts(w, gptq, "g_idx"))  # each part's inputs are the layer's
    # compressed-tensors: zero points packed eight rows a word, `weight_shape` per part
    packed_zeros = rng.integers(0, 2**31, size=(8, 3), dtype=np.int32)
    assert [p.shape for p in _parts(packed_zeros, OutputUnits(), "weight_zero_point")] == [
        (2, 3),
        (2, 3),
        (4, 3),
    ]
    shapes = _parts(np.asarray([64, 24], np.int64), OutputUnits(), "weight_shape")
    assert [p.tolist() for p in shapes] == [[16, 24], [16, 24], [32, 24]]
    per_tensor = np.ones((1,), np.float32)
    assert all(p is per_tensor for p in _parts(per_tensor, OutputUnits(), "weight_scale"))
    # block fp8 scales: a block's rows an entry
    blocks = FusedOutputs(".qkv", (".q", ".k", ".v"), (256, 128, 128))
    scale = rng.random((4, 2)).astype(np.float32)
    cut = split_tensor("x.qkv.weight_scale_inv", scale, blocks, output_units(_FP8_CONFIG))
    assert [a.shape for _, a in cut] == [(2, 2), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match=r"'x\.qkv\.weight_scale_inv'.*\[16, 16, 32\].*multiples of 128"):
        split_tensor("x.qkv.weight_scale_inv", scale[:1], QKV, output_units(_FP8_CONFIG))
    with pytest.raises(ValueError, match=r"'x\.qkv\.weight' has shape \(63, 24\)"):
        _parts(w[:63], OutputUnits())


_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
