# SPDX-License-Identifier: Apache-2.0
"""Gemma 3 (text) against transformers fp32 (q/k (1 + w) norms, local layers with their own RoPE
base, linear RoPE scaling on global layers, window 10 < prompt, final soft-capping): logits
(prefill, ragged mixed batch) and greedy generation through vLLM."""

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

ARCH = "Gemma3ForCausalLM"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(ARCH, str(tmp_path_factory.mktemp("gemma3")))
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
    assert vllm_greedy_matches(path, hf, [7, 40, 25])["kv_groups"] >= 2


def _hf_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_layer_windows_and_rope(tiny):
    path, config, _, _ = tiny
    assert config.layer_sliding_windows == (10, None, 10) and config.sliding_window is None
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.factor) == (20000, 1000, 2)
    # The same model as a pre-transformers-5 config.json describes it.
    legacy = _hf_config(path)
    for key in ("layer_types", "rope_parameters"):
        del legacy[key]
    legacy.update(
        sliding_window_pattern=2,
        rope_theta=20000.0,
        rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    assert ModelConfig.from_hf_dict(legacy) == config
