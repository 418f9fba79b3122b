# SPDX-License-Identifier: Apache-2.0
"""An independent reference of an EAGLE-3 head's greedy drafts, in plain torch on the checkpoint's
tensors (no vllm-xla code): the target's hidden states from transformers
(`output_hidden_states`: each layer's input, whatever its kind, a Gated DeltaNet layer's too; the
last layer's output before the final norm), then the head over the whole sequence with full causal
attention at every draft step, as vLLM's `Eagle3LlamaForCausalLM` computes it."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Llama's rotary embedding of `x [T, N, H]` (halves rotated)."""
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, h, 2, dtype=torch.float32) / h)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    first, second = x[..., : h // 2], x[..., h // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def layer_after_attention_input(
    x: torch.Tensor, residual: torch.Tensor, w: dict, p: str, c: dict
) -> torch.Tensor:
    """A Llama decoder layer from its attention's input `x [T, *]` on: causal attention over
    the T positions (RoPE at 0..T-1), added to `residual`, then the post-attention norm and the
    gated MLP added (tensors `w[p + ...]`, hyper-parameters `c`)."""
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c["hidden_size"] // heads
    t = x.shape[0]
    positions = torch.arange(t)
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, hd), positions, c["rope_theta"])
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, hd), positions, c["rope_theta"])
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qnh,knh->nqk", q, k) * hd**-0.5
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("nqk,knh->qnh", scores.softmax(-1), v).reshape(t, heads * hd)
    residual = residual + attn @ w[p + "self_attn.o_proj.weight"].T
    y = _rms(residual, w[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
    mlp = torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
    return residual + mlp @ w[p + "mlp.down_proj.weight"].T


class Eagle3Reference:
    """The head of `head_dir` for `target` (a transformers causal LM: Llama, Qwen3-Next, ...)."""

    def __init__(self, head_dir: str, target, aux_layers: tuple[int, ...]):
        with open(os.path.join(head_dir, "config.json")) as f:
            self.config = json.load(f)
        self.w = load_file(os.path.join(head_dir, "model.safetensors"))
        self.target = target
        self.aux_layers = sorted(aux_layers)
        if "embed_tokens.weight" not in self.w:
            self.w["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()

    def _layer(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The head's output before its norm at every position, causal over the sequence."""
        c, w, p = self.config, self.w, "midlayer."
        eps = c["rms_norm_eps"]
        embeds = w["embed_tokens.weight"][torch.tensor(tokens)]
        x = torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], eps),
                       _rms(hidden, w[p + "hidden_norm.weight"], eps)], -1)  # fmt: skip
        return layer_after_attention_input(x, hidden, w, p, c)

    def _draft(self, hidden: torch.Tensor) -> int:
        logits = _rms(hidden, self.w["norm.weight"], self.config["rms_norm_eps"]) @ self.w["lm_head.weight"].T
        draft = int(logits.argmax())
        return draft + int(self.w["d2t"][draft]) if "d2t" in self.w else draft

    def _layer_inputs(self, tokens: list[int]) -> list[torch.Tensor]:
        """Each target layer's input, then the last layer's output before the final norm, as
        vLLM's index `num_layers` reads it (transformers' last hidden state is after the norm)."""
        final = []
        hook = self.target.model.norm.register_forward_pre_hook(lambda _, args: final.append(args[0]))
        try:
            out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        finally:
            hook.remove()
        return [*out.hidden_states[:-1], final[0]]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The head's k greedy drafts after `tokens` (the request's whole history)."""
        states = self._layer_inputs(tokens)
        aux = torch.cat([states[i][0] for i in self.aux_layers], -1)[:-1]  # positions 0..L-2
        hidden = aux @ self.w["fc.weight"].T
        inputs = list(tokens[1:])  # position p reads the token at p + 1
        drafts = []
        for _ in range(k):
            prenorm = self._layer(inputs, hidden)
            drafts.append(self._draft(prenorm[-1]))
            inputs.append(drafts[-1])
            hidden = torch.cat([hidden, prenorm[-1:]], 0)
        return drafts
