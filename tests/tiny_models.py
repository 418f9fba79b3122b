# SPDX-License-Identifier: Apache-2.0
"""Tiny random HF checkpoints built locally (no hub): config + weights + a trained BPE tokenizer."""

from __future__ import annotations

import os

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "hello world, hello vllm, hello xla and jax on tpu gpu cpu",
    "Once upon a time there was a small model that generated text.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? . , ; :",
]


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, saved as HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def save_tiny_llama(path: str, *, seed: int = 0, **overrides: object) -> str:
    """Saves a random tiny `LlamaForCausalLM` (fp32 safetensors) with a tokenizer; returns path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    save_tokenizer(path, vocab_size=384)
    kwargs = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = LlamaConfig(**kwargs)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Larger-than-default init so greedy text is not degenerate repetition.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_damped_tiny_llama(path: str, *, seed: int, scale: float) -> str:
    """`save_tiny_llama` with every layer's attention and MLP outputs scaled by `scale`: its greedy
    text falls into loops that drafts can predict, while every layer still changes the logits
    (some drafts fail). Returns path."""
    import torch
    from transformers import LlamaForCausalLM

    save_tiny_llama(path, seed=seed)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(path, safe_serialization=True)
    return path
