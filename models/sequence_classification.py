# SPDX-License-Identifier: Apache-2.0
"""`*ForSequenceClassification`: a decoder whose head is the checkpoint's `score` weight.

The trunk is the causal LM's; the head maps a hidden state to `num_labels` logits instead of the
vocabulary (HF `score.weight` `[L, D]`, no bias), so `compute_logits` gives the class logits of the
rows it is handed. Which row a sequence is classified by (its last token) is the runner's pooling.
"""

from __future__ import annotations

import jax.numpy as jnp

from models.config import ModelConfig
from models.linear import Linear
from models.llama import HF_PARAM_MAP as LLAMA_PARAM_MAP
from models.llama import LlamaForCausalLM
from models.qwen3 import HF_PARAM_MAP as QWEN3_PARAM_MAP
from models.qwen3 import Qwen3ForCausalLM


def classifier_param_map(causal_lm_map: dict[str, str]) -> dict[str, str]:
    """A causal LM's HF name table with the `score` head in place of `lm_head`."""
    table = {hf: ours for hf, ours in causal_lm_map.items() if hf != "lm_head.weight"}
    table["score.weight"] = "lm_head.kernel"
    return table


class _ScoreHead:
    """Mixed in before a causal LM: its LM head replaced by the `[D, num_labels]` score head."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype):
        if config.num_labels < 1:
            raise ValueError(
                f"{config.architecture} needs num_labels >= 1 (config.json's id2label or num_labels)"
            )
        super().__init__(config, dtype=dtype)
        self.lm_head = Linear(config.hidden_size, config.num_labels, bias=False, dtype=dtype)


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    hf_param_map = classifier_param_map(LLAMA_PARAM_MAP)


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    hf_param_map = classifier_param_map(QWEN3_PARAM_MAP)
