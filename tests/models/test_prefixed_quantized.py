# SPDX-License-Identifier: Apache-2.0
"""Quantized checkpoints of a multimodal model as they ship: the text model under a prefix
(Llama 4's `language_model.`), the recipe's `ignore` naming prefixed modules (the vision tower,
`language_model.lm_head`). Every quantized format's layers are matched through the model's own
name rule (`models.loader.model_name_rule`), as its float weights are; the logits are
transformers' on the dequantized weights (text-only inputs: the vision tower is not read)."""

import os

import numpy as np
import pytest
from safetensors import safe_open

from models import int4, load_model
from models.fp8 import FP8_DTYPE
from models.linear import kept_float
from models.loader import keep_checkpoint_float_layers
from models.registry import build
from tests.models.awq_checkpoints import write_awq
from tests.models.fp8_checkpoints import dequantized_weights, write_compressed_fp8, write_float
from tests.models.gptq_checkpoints import write_gptq
from tests.models.tiny_checkpoints import assert_prefill_matches, load_pair, save_tiny_llama4_multimodal

ARCH = "Llama4ForConditionalGeneration"
TEXT = "language_model.model.layers"
# What recipes for these checkpoints leave float: the towers read by name, the head, the router.
IGNORE = ["re:.*vision_model.*", "re:.*multi_modal_projector.*", "language_model.lm_head", "re:.*router"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_llama4_multimodal(str(tmp_path_factory.mktemp("llama4mm")))


def _names(path: str) -> list[str]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        return list(f.keys())


def _write(kind: str, source: str, out: str) -> tuple[str, dict[str, np.ndarray]]:
    """The prefixed checkpoint in format `kind` by this suite's packers (the formats' published
    layouts), and its dequantized weights by (prefixed) HF name."""
    if kind == "gptq":
        return write_gptq(source, out, group_size=32)
    if kind == "gptq-act-order":
        return write_gptq(source, out, group_size=32, sym=False, act_order=7)
    if kind == "awq":
        return write_awq(source, out, group_size=32)
    path = write_compressed_fp8(source, out, "FP8_DYNAMIC", model_class=ARCH, ignore=IGNORE)
    return path, dequantized_weights(path)


# One format in make test (GPTQ with activation order: its `g_idx` renamed too), the rest in full.
_FULL = pytest.mark.full


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("gptq-act-order", marks=pytest.mark.slow),
        pytest.param("gptq", marks=_FULL),
        pytest.param("awq", marks=_FULL),
        pytest.param("fp8", marks=_FULL),
    ],
)
def test_prefixed_checkpoint_computes_its_dequantized_model(source, kind, tmp_path):
    path, dequantized = _write(kind, source, str(tmp_path / kind))
    scale = ".weight_scale" if kind == "fp8" else ".scales"
    assert f"{TEXT}.0.self_attn.q_proj{scale}" in _names(path)
    config, model = load_model(path)
    q = model.model.layers[0].self_attn.qkv_proj.kernel[...]
    assert q.dtype == (FP8_DTYPE if kind == "fp8" else int4.held_dtype())
    assert model.model.layers[1].mlp.shared_expert.down_proj.kernel_scale is not None
    _, _, hf = load_pair(ARCH, write_float(source, str(tmp_path / "float"), dequantized))
    assert_prefill_matches(model, config, hf, 29)


def test_a_prefixed_quantized_tensor_that_maps_to_nothing_is_refused_by_name(source, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = write_gptq(source, str(tmp_path / "gptq"), group_size=32)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    stray = f"{TEXT}.0.self_attn.x_proj"
    for part in ("qweight", "qzeros", "scales"):
        tensors[f"{stray}.{part}"] = tensors[f"{TEXT}.0.self_attn.q_proj.{part}"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.x_proj\.weight'.*no weight"):
        load_model(path)


@pytest.mark.slow  # the compressed-tensors package writes it from the torch model
def test_layers_a_prefixed_recipe_ignores_stay_float(source, tmp_path):
    """The recipe's `ignore` naming a prefixed module: loaded float, and marked so that a
    quantization pass at load leaves it as the checkpoint holds it."""
    from models import ModelConfig

    ignore = (*IGNORE, f"{TEXT}.2.self_attn.o_proj")
    path = write_compressed_fp8(source, str(tmp_path / "fp8"), "FP8_DYNAMIC", model_class=ARCH, ignore=ignore)

    model = build(ModelConfig.from_pretrained(path), np.float32)
    kept = keep_checkpoint_float_layers(model, path)  # the head and routers too, as the recipe says
    assert "model.layers.2.self_attn.o_proj" in kept and "model.layers.0.self_attn.o_proj" not in kept
    assert kept_float(model.model.layers[2].self_attn.o_proj)
    _, loaded = load_model(path)
    assert loaded.model.layers[2].self_attn.o_proj.kernel[...].dtype == np.float32
    assert loaded.model.layers[0].self_attn.o_proj.kernel[...].dtype == FP8_DTYPE


@pytest.mark.full  # the compressed-tensors package quantizes and transformers dequantizes a torch model
def test_compressed_tensors_w4a16_of_a_multimodal_checkpoint_as_it_ships(source, tmp_path):
    """Written by the compressed-tensors package from the transformers multimodal model, its
    recipe's `ignore` naming the vision tower and `language_model.lm_head`: the text
    projections load as their 4-bit values, and the logits are transformers' on the weights
    the package's own unpacking gives times their scales. (transformers' own
    `CompressedTensorsConfig(dequantize=True)` load of this model gives NaN logits.)"""
    from tests.models.int4_checkpoints import package_dequantized, write_compressed_w4a16

    out = write_compressed_w4a16(
        source, str(tmp_path / "w4a16"), group_size=32, model_class=ARCH, ignore=IGNORE
    )
    names = _names(out)
    assert f"{TEXT}.0.self_attn.q_proj.weight_packed" in names
    assert "language_model.lm_head.weight" in names  # ignored: float, under its prefix
    config, model = load_model(out)
    with safe_open(f"{out}/model.safetensors", framework="numpy") as f:
        packed = f.get_tensor(f"{TEXT}.0.feed_forward.down_proj.weight_packed")
    down = model.model.layers[0].mlp.down_proj
    np.testing.assert_array_equal(np.asarray(down.kernel[...]), int4.unpack_int32(packed).T.astype(np.int8))
    assert model.lm_head.kernel[...].dtype == np.float32
    _, _, hf = load_pair(ARCH, write_float(source, str(tmp_path / "float"), package_dequantized(out)))
    assert_prefill_matches(model, config, hf, 29)


@pytest.mark.full  # a second multimodal checkpoint built; the name rule's Llama 4 case is in make test
def test_gemma4_w4a16_under_model_language_model_computes_its_dequantized_model(tmp_path):
    """Gemma 4 as released (`model.language_model.` text model; its vision tower's projections
    quantized too, and not read): the text projections load as their 4-bit values."""
    from tests.models.int4_checkpoints import write_packed_w4a16
    from tests.models.test_gemma4_multimodal import ARCH as GEMMA4
    from tests.models.test_gemma4_multimodal import save_tiny_gemma4_multimodal

    source = save_tiny_gemma4_multimodal(str(tmp_path / "source"))
    path, dequantized = write_packed_w4a16(source, str(tmp_path / "w4a16"), group_size=16)
    names = _names(path)
    assert "model.language_model.layers.0.self_attn.q_proj.weight_packed" in names
    assert any(n.startswith("model.vision_tower.") and n.endswith("weight_packed") for n in names)
    config, model = load_model(path)
    assert model.model.layers[0].mlp.down_proj.kernel[...].dtype == int4.held_dtype()
    _, _, hf = load_pair(GEMMA4, write_float(source, str(tmp_path / "float"), dequantized))
    assert_prefill_matches(model, config, hf, 29)
