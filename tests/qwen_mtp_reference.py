# SPDX-License-Identifier: Apache-2.0
"""An independent reference of Qwen3-Next's and Qwen3.5's multi-token-prediction layer and its
greedy drafts, in torch on the checkpoint's tensors (no vllm-xla code), from the formula vLLM's
`Qwen3NextMultiTokenPredictor` computes:

    h' = norm(block(fc(concat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)))))

with `(1 + w)` norms, `block` transformers' own full-attention decoder layer of the target (built
as one layer past the target's, holding `mtp.layers.0.*`), full causal attention over the whole
sequence at every draft step, drafts the argmax of the target's LM head over `h'`, and each next
step reading `h'`."""

from __future__ import annotations

import copy
import os

import torch
from safetensors.torch import load_file

from tests.mtp_reference import GreedyDrafts


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _stacked_experts(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert tensors stacked as transformers' experts module holds them."""
    experts = sorted({int(k.split(".")[2]) for k in block if k.startswith("mlp.experts.")})
    if not experts:
        return block
    out = {k: v for k, v in block.items() if not k.startswith("mlp.experts.")}
    one = lambda e, proj: block[f"mlp.experts.{e}.{proj}.weight"]  # noqa: E731
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([one(e, "gate_proj"), one(e, "up_proj")]) for e in experts]
    )
    out["mlp.experts.down_proj"] = torch.stack([one(e, "down_proj") for e in experts])
    return out


class QwenMtpReference(GreedyDrafts):
    """The MTP layer of the checkpoint at `path`; `target`: transformers' model of it."""

    def __init__(self, path: str, target):
        tensors = load_file(os.path.join(path, "model.safetensors"))
        self.w = {k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")}
        config = copy.deepcopy(target.config)
        index = config.num_hidden_layers
        config.layer_types = [*config.layer_types, "full_attention"]
        config.num_hidden_layers = index + 1
        config._attn_implementation = "eager"
        full = target.model.layers[config.layer_types.index("full_attention")]
        self.block = type(full)(config, index).to(torch.float32).eval()
        block = {k.removeprefix("layers.0."): v for k, v in self.w.items() if k.startswith("layers.0.")}
        self.block.load_state_dict(_stacked_experts(block), strict=True)
        self.rotary, self.eps = target.model.rotary_emb, config.rms_norm_eps
        self.embedding = target.model.embed_tokens.weight.detach()  # shared with the target
        self.target = target

    @torch.no_grad()
    def layer(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """`h'` at every position of `tokens [T]` with the target's hidden states `hidden [T, D]`."""
        w, t = self.w, len(tokens)
        positions = torch.arange(t)
        embeds = self.embedding[torch.tensor(tokens)]
        x = torch.cat(
            [
                _rms(embeds, w["pre_fc_norm_embedding.weight"], self.eps),
                _rms(hidden, w["pre_fc_norm_hidden.weight"], self.eps),
            ],
            -1,
        )
        x = (x @ w["fc.weight"].T)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x, positions[None])
        out = self.block(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions[None])
        out = out[0] if isinstance(out, tuple) else out
        return _rms(out[0], w["norm.weight"], self.eps)

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(h)

    def recycled(self, h: torch.Tensor) -> torch.Tensor:
        return h
