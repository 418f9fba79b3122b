# SPDX-License-Identifier: Apache-2.0
"""Tiny checkpoints trained for a few seconds on a fixed public-domain text, and teacher-forced
runs of our models over it.

A random tiny model's next-token choices are near ties, so any rounding flips them; one trained
on the text has the margins of a real model there, which is what an int8 agreement check needs.
"""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import AttentionMetadata, ModelConfig
from pallas_kernels import allocate_kv_cache
from tests.models.tiny_checkpoints import _COMMON, TINY
from tests.tiny_models import save_tokenizer

TEXT = (pathlib.Path(__file__).parents[1] / "data" / "alice.txt").read_text()
PAGE = 16


def text_ids(path: str, limit: int = 256) -> list[int]:
    """The fixed text's first `limit` token ids under the tokenizer at `path` (BOS first)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(TEXT)["input_ids"][:limit]


def save_trained_tiny(
    architecture: str, path: str, *, steps: int = 30, seed: int = 0, **overrides: object
) -> str:
    """A tiny `architecture` (Llama, or one of `TINY`) trained on the fixed text, saved as fp32
    safetensors with its tokenizer; returns `path`. `overrides`: config fields (widths, say)."""
    import torch
    import transformers

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=_COMMON["vocab_size"])
    config_class, arch_overrides = TINY.get(architecture, ("LlamaConfig", {}))
    config = getattr(transformers, config_class)(**{**_COMMON, **arch_overrides, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    ids = torch.tensor([text_ids(path)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@jax.jit
def _logits(graphdef, state, kv_caches, ids, positions, md):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(ids, positions, kv_caches, md)
    return model.compute_logits(hidden)


def teacher_forced_logits(
    model: nnx.Module, config: ModelConfig, ids: list[int], dtype=jnp.float32
) -> np.ndarray:
    """float32 logits `[len(ids), V]` of one prefill of `ids` (each position predicts the next)."""
    n = len(ids)
    pages = -(-n // PAGE)
    caches = [
        allocate_kv_cache(pages + 1, PAGE, config.num_kv_heads, config.head_dim, dtype, backend="xla")
        for _ in range(config.num_layers)
    ]
    positions = np.arange(n, dtype=np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(positions + PAGE, jnp.int32),  # pages 1.. in order
        kv_lens=jnp.asarray([n], jnp.int32),
        page_indices=jnp.asarray([list(range(1, pages + 1))], jnp.int32),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
        backend="xla",
    )
    graphdef, state = nnx.split(model)
    ids_array = jnp.asarray(ids, jnp.int32)
    return np.asarray(_logits(graphdef, state, caches, ids_array, jnp.asarray(positions), md), np.float32)


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of `ids[1:]` under `logits[:-1]` (float64)."""
    z = logits[:-1].astype(np.float64)
    log_probs = z - z.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nll = -log_probs[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(np.exp(nll.mean()))
