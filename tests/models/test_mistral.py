# SPDX-License-Identifier: Apache-2.0
"""Mistral with a sliding window (12 tokens, smaller than the prompts) against transformers fp32:
logits (prefill, ragged mixed batch) and greedy generation through vLLM on our platform, where
every layer reports a sliding-window KV spec, so vLLM frees pages that left the window."""

import pytest

from tests.models.tiny_checkpoints import (
    assert_prefill_matches,
    assert_ragged_matches,
    load_pair,
    save_tiny,
    vllm_greedy_matches,
)

ARCH = "MistralForCausalLM"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(ARCH, str(tmp_path_factory.mktemp("mistral")))
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


def test_every_layer_slides(tiny):
    _, config, _, _ = tiny
    assert config.layer_sliding_windows == (12, 12) and config.sliding_window == 12
