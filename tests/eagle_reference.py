# SPDX-License-Identifier: Apache-2.0
"""An independent reference of an EAGLE-1 head's greedy drafts, in plain torch on the checkpoint's
tensors (no vllm-xla code): the target's final hidden states from transformers (after its norm,
`output_hidden_states`' last), then the head over the whole sequence with full causal attention
at every draft step, as vLLM's `EagleLlamaForCausalLM` computes it: `fc(concat(embed(token),
hidden))`, one Llama layer without its input norm, the LM head on its output without a norm."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from tests.eagle3_reference import layer_after_attention_input


class EagleReference:
    """The head of `head_dir` for `target` (a transformers causal LM), its embedding and LM head
    the target's where the checkpoint has none (the target's embedding where it ties its head)."""

    def __init__(self, head_dir: str, target):
        with open(os.path.join(head_dir, "config.json")) as f:
            config = json.load(f)
        self.config = config.get("model", config)
        self.w = load_file(os.path.join(head_dir, "model.safetensors"))
        self.target = target
        if "embed_tokens.weight" not in self.w:
            self.w["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
        if "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = target.get_output_embeddings().weight.detach()

    def _layer(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The head's output at every position, causal over the sequence."""
        w = self.w
        x = torch.cat([w["embed_tokens.weight"][torch.tensor(tokens)], hidden], -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        return layer_after_attention_input(x, x, w, "layers.0.", self.config)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The head's k greedy drafts after `tokens` (the request's whole history)."""
        final = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        hidden = final[:-1]  # positions 0..L-2
        inputs = list(tokens[1:])  # position p reads the token at p + 1
        drafts = []
        for _ in range(k):
            out = self._layer(inputs, hidden)
            drafts.append(int((out[-1] @ self.w["lm_head.weight"].T).argmax()))
            inputs.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]], 0)
        return drafts
