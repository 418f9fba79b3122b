# SPDX-License-Identifier: Apache-2.0
"""Qwen3-MoE (8 experts, top 2, no renormalization, a dense-MLP layer via `mlp_only_layers`)
against transformers fp32: logits (prefill, ragged mixed batch) and greedy generation through vLLM."""

import pytest

from models.layers import GatedMLP
from models.moe import SparseMoE
from tests.models.tiny_checkpoints import (
    assert_prefill_matches,
    assert_ragged_matches,
    load_pair,
    save_tiny,
    vllm_greedy_matches,
)

ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(ARCH, str(tmp_path_factory.mktemp("qwen3_moe")))
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


def test_sparse_and_dense_layers(tiny):
    _, config, model, _ = tiny
    assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoE, GatedMLP, SparseMoE]
    assert not model.model.layers[0].mlp.renormalize
