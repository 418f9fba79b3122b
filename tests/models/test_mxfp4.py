# SPDX-License-Identifier: Apache-2.0
"""GPT-OSS with mxfp4 experts kept in mxfp4 (`models.mxfp4`): the format decoded as transformers
decodes it, the served model equal to transformers running the dequantized checkpoint, and
malformed checkpoints refused by name."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.config import ModelConfig
from models.loader import load_model
from models.mxfp4 import Mxfp4Stack
from tests.models.mxfp4_checkpoint import pack_mxfp4, save_tiny_gpt_oss_mxfp4, transformers_dequantized
from tests.models.tiny_checkpoints import (
    PAGE,
    assert_prefill_matches,
    assert_ragged_matches,
    prompts,
    run_step,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    return save_tiny_gpt_oss_mxfp4(str(tmp_path_factory.mktemp("gpt_oss_mxfp4")), seed=5)


@pytest.fixture(scope="module")
def served(checkpoints):
    import torch
    import transformers

    config, model = load_model(checkpoints[0])
    hf = transformers.GptOssForCausalLM.from_pretrained(
        checkpoints[1], dtype=torch.float32, attn_implementation="eager"
    )
    return config, model, hf.eval()


def test_decoding_equals_transformers_and_the_packer_rounds_to_nearest():
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.3, (3, 8, 96)).astype(np.float32)  # [E, out, in]
    weight[0, 0, :32] = 0.0  # an all-zero block
    weight[1, 2, 5] = 44.0  # a block with one large value: the others round towards zero
    blocks, scales = pack_mxfp4(weight)
    assert blocks.shape == (3, 8, 3, 16) and scales.shape == (3, 8, 3)
    ours = np.asarray(Mxfp4Stack(jnp.asarray(blocks), jnp.asarray(scales)).dense(jnp.float32))  # [E, in, out]
    reference = transformers_dequantized(blocks, scales)  # [E, in, out]
    np.testing.assert_array_equal(ours, reference)
    # bfloat16 is exact too: every FP4 value times a power of two is a bfloat16.
    bf16 = Mxfp4Stack(jnp.asarray(blocks), jnp.asarray(scales)).dense(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16, np.float32), reference)
    # Round to nearest: within half an FP4 step (at most 1 in a block scaled to (3, 6]) of the weight.
    step = np.exp2(scales.astype(np.float32) - 127)  # [E, out, G]
    error = np.abs(np.swapaxes(reference, 1, 2) - weight).reshape(3, 8, 3, 32)
    assert np.all(error <= step[..., None] + 1e-7)
    assert reference[1, 5, 2] == 48.0  # 44 / 2**3 = 5.5 -> 6, the top FP4 value


def test_served_mxfp4_model_matches_transformers_on_the_dequantized_checkpoint(served):
    config, model, hf = served
    assert config.mxfp4
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks[...].dtype == jnp.uint8
    assert experts.gate_up_proj_blocks[...].shape == (8, 128, 2, 16)  # [E, 2F, D / 32, 16]
    assert experts.down_proj_scales[...].shape == (8, 64, 2)  # [E, D, F / 32]
    assert not hasattr(experts, "gate_up_proj")  # no dequantized copy is held
    assert_ragged_matches(model, config, hf, [5, 9, 3])  # every position of three prefills, then a mixed step


@pytest.mark.slow  # the served model's check again in bfloat16
def test_in_bfloat16_the_mxfp4_model_equals_the_dequantized_checkpoint(checkpoints):
    # Every FP4 value times its power-of-two scale is a bfloat16: the experts dequantized tile by
    # tile are exactly the float checkpoint's weights cast to bfloat16.
    from pallas_kernels import allocate_kv_cache

    (ids,) = prompts([11], seed=2)
    logits = []
    for path in checkpoints:
        config, model = load_model(path, jnp.bfloat16)
        kv = [
            allocate_kv_cache(4, PAGE, config.num_kv_heads, config.head_dim, jnp.bfloat16, backend="xla")
            for _ in range(config.num_layers)
        ]
        logits.append(run_step(model, kv, [ids], [0], [[1]])[0])
    np.testing.assert_array_equal(*logits)


@pytest.mark.slow  # a second mxfp4 model
def test_experts_padded_to_whole_blocks_a_device_serve_the_same(checkpoints, served):
    # F = 64 is two blocks of 32: for 4 devices it is padded to 128 (one block a device) with
    # zero gate/up pairs and down inputs, which add nothing.
    config, _, hf = served
    _, padded = load_model(checkpoints[0])
    for layer in padded.model.layers:
        layer.mlp.experts.pad_for_mesh(4)
    experts = padded.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks[...].shape == (8, 256, 2, 16)  # [E, 2F', D / 32, 16]
    assert experts.gate_up_proj_bias[...].shape == (8, 256)
    assert experts.down_proj_blocks[...].shape == (8, 64, 4, 16)  # [E, D, F' / 32, 16]
    assert_prefill_matches(padded, config, hf, 13)


def _malformed_copy(source: str, target: str, edit) -> str:
    import shutil

    shutil.copytree(source, target)
    file = os.path.join(target, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return target


def test_missing_scales_are_refused_by_name(checkpoints, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.mlp.experts.down_proj_scales"]

    path = _malformed_copy(checkpoints[0], str(tmp_path / "m"), drop)
    with pytest.raises(ValueError, match=r"lacks 1 parameters.*layers\.1\.mlp\.experts\.down_proj_scales"):
        load_model(path)


def test_a_wrong_block_shape_is_refused_by_name(checkpoints, tmp_path):
    def regroup(tensors):  # 16-value blocks of 8 bytes instead of 32 of 16
        name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
        tensors[name] = tensors[name].reshape(8, 128, 4, 8)

    path = _malformed_copy(checkpoints[0], str(tmp_path / "m"), regroup)
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks.*shape \(8, 128, 4, 8\)"):
        load_model(path)


def test_hidden_size_not_in_whole_blocks_is_refused(checkpoints):
    with open(os.path.join(checkpoints[0], "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match=r"mxfp4 checkpoint.*hidden_size.*32-value blocks"):
        ModelConfig.from_hf_dict({**hf, "hidden_size": 48})
