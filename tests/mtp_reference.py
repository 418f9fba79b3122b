# SPDX-License-Identifier: Apache-2.0
"""An independent reference of a multi-token-prediction layer (DeepSeek-V3's, GLM-4.5's) and its
greedy drafts, in torch on the checkpoint's tensors (no vllm-xla code), from the formula vLLM's
`DeepSeekMultiTokenPredictorLayer` and `Glm4MoeMultiTokenPredictorLayer` compute:

    h' = block(eh_proj(concat(enorm(embed(token)), hnorm(hidden))))

with the embedding of position 0 zeroed, `block` transformers' own decoder layer of the target
(the checkpoint read with one layer more: the MTP layer's block is stored as that layer), full
causal attention over the whole sequence at every draft step, drafts the argmax of
`shared_head.head(shared_head.norm(h'))`, and each next step reading `shared_head.norm(h')`
(DeepSeek) or `h'` (GLM)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class GreedyDrafts:
    """An MTP reference's greedy drafts, from its `layer(tokens, hidden)`, `logits(h)` and
    `recycled(h)` (what the next step reads of `h'`), over its `target`'s hidden states."""

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """The target's final hidden states (after its norm) at every position of `tokens`."""
        return self.target.model(torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The layer's k greedy drafts after `tokens` (the request's whole history)."""
        hidden = self.target_hidden(tokens)[:-1]  # positions 0..L-2
        inputs = list(tokens[1:])  # position p reads the token at p + 1
        drafts = []
        for _ in range(k):
            h = self.layer(inputs, hidden)
            drafts.append(int(self.logits(h[-1]).argmax()))
            inputs.append(drafts[-1])
            hidden = torch.cat([hidden, self.recycled(h[-1:])], 0)
        return drafts


class MtpReference(GreedyDrafts):
    """The MTP layer of the checkpoint at `path`; `target`: transformers' model of it."""

    def __init__(self, path: str, target):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        index = config["num_hidden_layers"]
        self.eps = config["rms_norm_eps"]
        self.recycle_normed = config["architectures"][0] == "DeepseekV3ForCausalLM"
        extended = (
            type(target)
            .from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager", num_hidden_layers=index + 1
            )
            .eval()
        )
        self.block, self.rotary = extended.model.layers[index], extended.model.rotary_emb
        prefix = f"model.layers.{index}."
        tensors = load_file(os.path.join(path, "model.safetensors"))
        self.w = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        self.embedding = target.model.embed_tokens.weight.detach()  # shared with the target
        self.target = target

    @torch.no_grad()
    def layer(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """`h'` at every position of `tokens [T]` with the target's hidden states `hidden [T, D]`."""
        w, t = self.w, len(tokens)
        positions = torch.arange(t)
        embeds = self.embedding[torch.tensor(tokens)].clone()
        embeds[positions == 0] = 0.0
        x = torch.cat(
            [_rms(embeds, w["enorm.weight"], self.eps), _rms(hidden, w["hnorm.weight"], self.eps)], -1
        )
        x = (x @ w["eh_proj.weight"].T)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x, positions[None])
        return self.block(x, attention_mask=mask, position_ids=positions[None], position_embeddings=cos_sin)[
            0
        ]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.normed(h) @ self.w["shared_head.head.weight"].T

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        return _rms(h, self.w["shared_head.norm.weight"], self.eps)

    def recycled(self, h: torch.Tensor) -> torch.Tensor:
        return self.normed(h) if self.recycle_normed else h
