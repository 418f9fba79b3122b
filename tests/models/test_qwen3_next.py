# SPDX-License-Identifier: Apache-2.0
"""Tiny random Qwen3-Next, Qwen3.5 and Qwen3.5-MoE text models (tests/models/tiny_qwen3_next.py)
against transformers fp32, our model driven directly (one jitted step per call): logits at every
position of a prompt longer than one 64-token chunk of the gated delta rule; the same prompt in
two steps, the Gated DeltaNet states and the KV cache carried between them; a ragged batch of
prefills, then a mixed step of decodes and a 2-token chunk. A linear-attention layer's state
slot is its sequence's first block (here the sequence's first KV page). Plus the configs'
parsing and the MTP weights skipped on load."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig, load_model
from models.qwen3_next import Qwen3NextConfig
from pallas_kernels import allocate_kv_cache
from tests.models.tiny_checkpoints import PAGE, RTOL, hf_logits, prompts, run_step
from tests.models.tiny_qwen3_next import FIELDS, save_tiny_qwen3_next

# Logits reach ~10 here; the chunked rule's float32 triangular solves and state products round
# differently from transformers' (a few 1e-4 on a few logits), far below a wrong weight or state.
ATOL = 1e-3


# The fast tier runs Qwen3-Next; Qwen3.5's differences (its projections, its MoE) run in the slow one.
_ARCHITECTURES = [
    "Qwen3NextForCausalLM",
    pytest.param("Qwen3_5ForCausalLM", marks=pytest.mark.slow),
    pytest.param("Qwen3_5MoeForCausalLM", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=_ARCHITECTURES)
def tiny(request, tmp_path_factory):
    """(path, config, model, hf), built once per architecture."""
    import torch
    import transformers

    architecture = request.param
    path = save_tiny_qwen3_next(str(tmp_path_factory.mktemp(architecture)), architecture=architecture)
    config, model = load_model(path)
    hf = getattr(transformers, architecture).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return path, config, model, hf.eval()


def _caches(config, model, num_pages):
    """KV caches of `num_pages` pages for the attention layers, state pools of as many slots for
    the linear-attention ones (a sequence's slot: its first page)."""
    return [
        layer.linear_attn.allocate_state(num_pages, jnp.float32)
        if config.is_linear_attention(i)
        else allocate_kv_cache(
            num_pages, PAGE, config.num_kv_heads, config.head_dim, jnp.float32, backend="xla"
        )
        for i, layer in enumerate(model.model.layers)
    ]


def test_prefill_longer_than_a_chunk_matches_transformers(tiny):
    _, config, model, hf = tiny
    (ids,) = prompts([70], seed=70)
    logits, _ = run_step(model, _caches(config, model, 8), [ids], [0], [[5, 1, 2, 3, 4]])
    np.testing.assert_allclose(logits, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.slow  # two programs; the fast tier's one prefill crosses a chunk already
def test_prompt_in_two_steps_carries_the_states(tiny):
    _, config, model, hf = tiny
    # 66 tokens cross the rule's 64-token chunk; 4 more continue from the carried states.
    (ids,) = prompts([70], seed=71)
    pages = [[3, 1, 2, 4, 5]]
    first, caches = run_step(model, _caches(config, model, 8), [ids[:66]], [0], pages)
    second, _ = run_step(model, caches, [ids[66:]], [66], pages)
    np.testing.assert_allclose(np.concatenate([first, second]), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_ragged_prefills_then_decodes_and_a_chunk_match_transformers(tiny):
    _, config, model, hf = tiny
    lengths = [5, 16, 33]
    ps = prompts(lengths, seed=sum(lengths))
    pages = [[1], [2, 3], [4, 5, 6]]
    logits, caches = run_step(model, _caches(config, model, 8), ps, [0, 0, 0], pages)
    ends = np.cumsum(lengths) - 1
    for i, p in enumerate(ps):
        np.testing.assert_allclose(logits[ends[i]], hf_logits(hf, p)[-1], atol=ATOL, rtol=RTOL)
    new = [[11], [12], [13, 14]]
    logits, _ = run_step(model, caches, new, lengths, pages)
    rows = np.cumsum([len(n) for n in new]) - 1
    for i, p in enumerate(ps):
        full = hf_logits(hf, p + new[i])
        np.testing.assert_allclose(logits[rows[i]], full[-1], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(logits[rows[2] - 1], hf_logits(hf, ps[2] + [13])[-1], atol=ATOL, rtol=RTOL)


def test_config_reads_the_hybrid_layout(tiny):
    path, config, _model, _ = tiny
    assert isinstance(config, Qwen3NextConfig)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (config.rotary_dim, config.linear_num_key_heads, config.linear_num_value_heads) == (4, 2, 4)
    routed = {
        "Qwen3NextForCausalLM": [True, False, True, True],
        "Qwen3_5ForCausalLM": [False] * 4,
        "Qwen3_5MoeForCausalLM": [True] * 4,  # no dense layers, whatever mlp_only_layers says
    }[config.architecture]
    assert [config.is_moe_layer(i) for i in range(4)] == routed
    assert config.split_linear_projections == config.architecture.startswith("Qwen3_5")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert ModelConfig.from_hf_dict(hf) == config
    del hf["layer_types"]  # transformers' default: every 4th layer full
    hf["num_hidden_layers"] = 8
    parsed = ModelConfig.from_hf_dict(hf)
    assert [i for i in range(8) if not parsed.is_linear_attention(i)] == [3, 7]


def test_unknown_layer_type_is_refused_by_name():
    hf = {
        **FIELDS,
        "architectures": ["Qwen3NextForCausalLM"],
        "layer_types": ["linear_attention", "mamba"] * 2,
    }
    with pytest.raises(ValueError, match="layer_types must name 4 layers"):
        ModelConfig.from_hf_dict(hf)


def test_multi_token_prediction_weights_are_skipped_on_load(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = save_tiny_qwen3_next(str(tmp_path / "ckpt"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _config, model = load_model(path, on_host=True)
    conv = np.asarray(model.model.layers[0].linear_attn.conv1d.weight[...])
    np.testing.assert_array_equal(conv, tensors["model.layers.0.linear_attn.conv1d.weight"].numpy())
