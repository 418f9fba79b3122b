# SPDX-License-Identifier: Apache-2.0
"""Tiny random HF checkpoints of every supported architecture, and the checks run on each.

A checkpoint is built with the architecture's transformers config class, re-initialised with a
larger std than HF's default (so greedy text is not one repeated token) and saved as fp32
safetensors with a trained tokenizer. `TINY` holds each architecture's config: hidden 64,
vocab 384, 2-3 layers, and small sliding windows / soft caps so every option actually bites.

The checks drive our model directly (one jitted step per call, the `xla` attention backend) and
compare its logits with transformers fp32 (eager attention); `vllm_greedy_matches` runs the real
vLLM engine on our platform against a transformers greedy reference.
"""

from __future__ import annotations

import functools
import gc
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import AttentionMetadata, ModelConfig, load_model
from pallas_kernels import allocate_kv_cache, allocate_latent_cache
from tests.tiny_models import save_tokenizer

PAGE = 16
VOCAB = 384
ATOL = RTOL = 1e-4
# The architectures beside Llama that `save_tiny` builds (Llama has its own tests).
ARCHS = [
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "Gemma4ForCausalLM",
]

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# architecture -> (transformers config class name, overrides of _COMMON)
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen2ForCausalLM": ("Qwen2Config", dict(rope_theta=1000.0)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=12)),
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        dict(
            sliding_window=10,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
        ),
    ),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=10,
            query_pre_attn_scalar=24,
            final_logit_softcapping=5.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
    "MixtralForCausalLM": (
        "MixtralConfig",
        dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    ),
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "GptOssForCausalLM": (
        "GptOssConfig",
        dict(
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=6,  # layer 0 slides, layer 1 is full (the default layer_types)
            swiglu_limit=2.0,  # low enough that the clamps bite
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "Llama4ForCausalLM": (
        "Llama4TextConfig",
        dict(
            num_hidden_layers=4,  # layers 0-2 RoPE and chunked, layer 3 NoPE and global
            intermediate_size=32,  # the experts' and the shared expert's
            intermediate_size_mlp=64,  # the dense layers'
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,  # layers 1 and 3 MoE, 0 and 2 dense
            attention_chunk_size=8,  # shorter than the prompts
            floor_scale=4,  # the NoPE layer's query temperature grows within the prompts
            attn_scale=0.5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "Gemma4ForCausalLM": (
        "Gemma4TextConfig",
        dict(
            # sliding layers: 2 KV heads of 16; full ones: 1 KV head of 32 (keys as values);
            # layers 2 and 3 read the caches of layers 0 and 1
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            sliding_window=10,
            final_logit_softcapping=5.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.5,
                    "rope_theta": 20000.0,
                },
            },
            tie_word_embeddings=True,
        ),
    ),
    # Classifiers (a pooling engine's): the score head's labels.
    "LlamaForSequenceClassification": ("LlamaConfig", dict(num_labels=3)),
    "Qwen3ForSequenceClassification": ("Qwen3Config", dict(num_labels=1, tie_word_embeddings=True)),
}


def spread_parameters(model: Any) -> None:
    """Moves a torch model's parameters away from their init, in place, so that a wrong mapping
    shows: matrices drawn from N(0, 0.3), norms and biases (vectors) shifted by N(0, 0.2)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.2)


def save_tiny(architecture: str, path: str, *, seed: int = 0, **overrides: Any) -> str:
    """Saves a random tiny `architecture` checkpoint (fp32 safetensors) with a tokenizer; returns path."""
    import torch
    import transformers

    config_class, arch_kwargs = TINY[architecture]
    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=VOCAB)
    config = getattr(transformers, config_class)(**{**_COMMON, **arch_kwargs, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    spread_parameters(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, saved as a buffer
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_tiny_llama4_multimodal(path: str) -> str:
    """A random tiny `Llama4ForConditionalGeneration`: the tiny Llama 4 text model beside a
    one-layer vision tower and projector."""
    import torch
    import transformers

    save_tokenizer(path, vocab_size=VOCAB)
    vision = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vision_output_dim=64, projector_input_dim=64, projector_output_dim=64, image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Llama4Config(
        text_config={**_COMMON, **TINY["Llama4ForCausalLM"][1]}, vision_config=vision
    )
    config.architectures = ["Llama4ForConditionalGeneration"]
    torch.manual_seed(1)
    model = transformers.Llama4ForConditionalGeneration(config)  # float32 (its default)
    spread_parameters(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_pair(architecture: str, path: str) -> tuple[ModelConfig, nnx.Module, Any]:
    """Our model and the transformers fp32 model (eager attention) of the checkpoint at `path`."""
    import torch
    import transformers

    config, model = load_model(path)
    hf = getattr(transformers, architecture).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return config, model, hf.eval()


def hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def caches(config: ModelConfig, num_pages: int = 32) -> list[jax.Array]:
    if config.latent_cache_width:  # multi-head latent attention: one shared row a token
        width = config.latent_cache_width
        return [
            allocate_latent_cache(num_pages, PAGE, width, jnp.float32, backend="xla")
            for _ in range(config.num_layers)
        ]
    return [
        allocate_kv_cache(num_pages, PAGE, config.num_kv_heads, config.head_dim, jnp.float32, backend="xla")
        for _ in range(config.num_layers)
    ]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, kv_caches, ids, positions, md):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(ids, positions, kv_caches, md)
    return model.compute_logits(hidden), kv_caches


def run_step(
    model: nnx.Module,
    kv_caches: list[jax.Array],
    seqs: list[list[int]],
    starts: list[int],
    pages: list[list[int]],
) -> tuple[np.ndarray, list[jax.Array]]:
    """One ragged step: `seqs[i]` are sequence i's new tokens, from position `starts[i]`, in `pages[i]`."""
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    lens = [len(s) for s in seqs]
    positions = np.concatenate([np.arange(st, st + n) for n, st in zip(lens, starts, strict=True)])
    per_seq = np.split(positions, np.cumsum(lens)[:-1])
    slots = np.concatenate([np.asarray(pages[i])[p // PAGE] * PAGE + p % PAGE for i, p in enumerate(per_seq)])
    width = max(len(p) for p in pages)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        kv_lens=jnp.asarray([st + n for n, st in zip(lens, starts, strict=True)], jnp.int32),
        page_indices=jnp.asarray([list(p) + [0] * (width - len(p)) for p in pages], jnp.int32),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
        backend="xla",
    )
    graphdef, state = nnx.split(model)
    logits, kv_caches = _forward(
        graphdef, state, kv_caches, jnp.asarray(ids), jnp.asarray(positions, jnp.int32), md
    )
    return np.asarray(logits), kv_caches


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random prompts starting with BOS (id 1), other ids in [3, VOCAB)."""
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, VOCAB, n - 1).tolist()] for n in lengths]


def assert_prefill_matches(model: nnx.Module, config: ModelConfig, hf: Any, length: int) -> None:
    """One sequence of `length` tokens prefilled at once: every position's logits match HF."""
    (ids,) = prompts([length], seed=length)
    pages = list(range(1, 1 + -(-length // PAGE)))[::-1]  # reversed: pages need not be in order
    logits, _ = run_step(model, caches(config), [ids], [0], [pages])
    np.testing.assert_allclose(logits, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def assert_ragged_matches(model: nnx.Module, config: ModelConfig, hf: Any, lengths: list[int]) -> None:
    """A ragged prefill of several prompts, every position's logits matching HF (each prompt's
    pages out of order), then a mixed step (two decodes and a 2-token chunk). It holds
    `assert_prefill_matches`'s check, for three prompts at once."""
    assert len(lengths) == 3
    ps = prompts(lengths, seed=sum(lengths))
    pages, next_page = [], 1
    for n in lengths:
        count = -(-(n + 2) // PAGE)
        pages.append(list(range(next_page, next_page + count))[::-1])  # reversed: need not be in order
        next_page += count
    kv = caches(config, num_pages=next_page + 1)
    logits, kv = run_step(model, kv, ps, [0, 0, 0], pages)
    starts = np.cumsum([0, *lengths])
    for i, p in enumerate(ps):
        np.testing.assert_allclose(logits[starts[i] : starts[i + 1]], hf_logits(hf, p), atol=ATOL, rtol=RTOL)
    new = [[11], [12], [13, 14]]
    logits, _ = run_step(model, kv, new, lengths, pages)
    rows = np.cumsum([len(n) for n in new]) - 1
    for i, p in enumerate(ps):
        full = hf_logits(hf, p + new[i])
        np.testing.assert_allclose(logits[rows[i]], full[-1], atol=ATOL, rtol=RTOL)
        if len(new[i]) > 1:
            np.testing.assert_allclose(logits[rows[i] - 1], full[-2], atol=ATOL, rtol=RTOL)


def vllm_greedy_matches(
    path: str, hf: Any, lengths: list[int], new_tokens: int = 10, **llm_kwargs: Any
) -> dict[str, Any]:
    """vLLM on our platform generates, greedily, exactly what transformers does for these prompts.

    An 8-token step budget keeps warm-up to four programs and prefills long prompts in chunks
    smaller than the tiny sliding windows.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.greedy_reference import hf_greedy

    ps = prompts(lengths, seed=len(lengths))
    kwargs = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, seed=0)
    llm = LLM(model=path, **{**kwargs, **llm_kwargs})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
        stats = llm.collective_rpc("runner_stats")[0]
    finally:
        del llm
        gc.collect()
    got = [list(o.outputs[0].token_ids) for o in out]
    assert got == [hf_greedy(hf, p, new_tokens) for p in ps]
    return stats
