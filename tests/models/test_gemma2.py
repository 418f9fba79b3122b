# SPDX-License-Identifier: Apache-2.0
"""Gemma 2 against transformers fp32 (scaled embeddings, sandwich (1 + w) norms, gelu-tanh MLP,
query_pre_attn_scalar, attention and final soft-capping, sliding layers alternating with global
ones, window 10 < prompt): logits (prefill, ragged mixed batch) and greedy generation through vLLM."""

import json
import os

import pytest

from models import ModelConfig
from tests.models.tiny_checkpoints import (
    assert_prefill_matches,
    assert_ragged_matches,
    load_pair,
    save_tiny,
    vllm_greedy_matches,
)

ARCH = "Gemma2ForCausalLM"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(ARCH, str(tmp_path_factory.mktemp("gemma2")))
    return (path, *load_pair(ARCH, path))


def test_prefill_logits_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_prefill_matches(model, config, hf, 37)


def test_ragged_prefill_then_mixed_decode_match_transformers(tiny):
    _, config, model, hf = tiny
    assert_ragged_matches(model, config, hf, [5, 16, 33])


def test_vllm_greedy_matches_transformers(tiny):
    # Sliding and full layers mixed: two KV-cache groups (block tables), sliding pages freed by
    # vLLM; prompts longer than the window must generate what transformers does.
    path, _, _, hf = tiny
    assert vllm_greedy_matches(path, hf, [7, 40, 25])["kv_groups"] == 2


def _hf_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_layer_windows_alternate(tiny):
    path, config, _, _ = tiny
    assert config.layer_sliding_windows == (10, None) and config.sliding_window is None
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.query_pre_attn_scalar) == (5, 5, 24)
    legacy = _hf_config(path)
    del legacy["layer_types"]  # configs written before `layer_types`: even layers slide
    assert ModelConfig.from_hf_dict(legacy) == config
