# SPDX-License-Identifier: Apache-2.0
"""Mixtral (8 experts, top 2, per-expert HF tensors stacked on load) against transformers fp32:
logits (prefill, ragged mixed batch) and greedy generation through vLLM on our platform."""

import os

import pytest
from safetensors.numpy import load_file, save_file

from models import build, load_weights
from tests.models.tiny_checkpoints import (
    assert_prefill_matches,
    assert_ragged_matches,
    load_pair,
    save_tiny,
    vllm_greedy_matches,
)

ARCH = "MixtralForCausalLM"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(ARCH, str(tmp_path_factory.mktemp("mixtral")))
    return (path, *load_pair(ARCH, path))


def test_prefill_logits_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_prefill_matches(model, config, hf, 37)


def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


def test_vllm_greedy_matches_transformers(tiny):
    path, _, _, hf = tiny
    vllm_greedy_matches(path, hf, [7, 40, 25])


def test_experts_stack_per_layer(tiny):
    _, config, model, _ = tiny
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 2, 64)
    assert model.model.layers[0].mlp.experts.gate_proj.kernel[...].shape == (8, 64, 64)  # [E, D, F]
    assert model.model.layers[1].mlp.experts.down_proj.kernel[...].shape == (8, 64, 64)  # [E, F, D]


def test_missing_expert_is_named(tiny, tmp_path):
    path, config, _, _ = tiny
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lacks experts \[5\] of 'model.layers.1.mlp.experts.up_proj.kernel'"
    ):
        load_weights(build(config), str(tmp_path))
