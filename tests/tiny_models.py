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


def save_tiny_eagle3_head(
    path: str,
    target_dir: str,
    *,
    seed: int,
    aux_layer_ids: tuple[int, ...] | None,
    draft_vocab_size: int | None = None,
    own_embedding: bool = False,
) -> str:
    """Saves a random EAGLE-3 head for the tiny Llama at `target_dir` in vLLM's
    `LlamaForCausalLMEagle3` layout (`midlayer.*`, `fc`, `norm`, `lm_head`; `d2t` offsets and
    `t2d` when `draft_vocab_size` is smaller than the target's vocabulary, the draft ids then
    standing for a random sorted subset of it; `embed_tokens` only with `own_embedding`: else
    the head shares the target's). Returns path."""
    import json

    import torch
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    d, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim, inter = d // heads, target["intermediate_size"]
    draft_vocab = draft_vocab_size or vocab
    num_aux = len(aux_layer_ids) if aux_layer_ids else 3
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.3):
        return torch.randn(*shape, generator=generator) * std

    tensors = {
        "fc.weight": normal(d, num_aux * d, std=0.1),
        "midlayer.input_layernorm.weight": 1 + normal(d, std=0.1),
        "midlayer.hidden_norm.weight": 1 + normal(d, std=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + normal(d, std=0.1),
        "midlayer.self_attn.q_proj.weight": normal(heads * head_dim, 2 * d),
        "midlayer.self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.o_proj.weight": normal(d, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": normal(inter, d),
        "midlayer.mlp.up_proj.weight": normal(inter, d),
        "midlayer.mlp.down_proj.weight": normal(d, inter),
        "norm.weight": 1 + normal(d, std=0.1),
        "lm_head.weight": normal(draft_vocab, d),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = normal(vocab, d)
    if draft_vocab != vocab:
        chosen = torch.sort(torch.randperm(vocab, generator=generator)[:draft_vocab]).values
        tensors["d2t"] = chosen - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, chosen, True)
    os.makedirs(path, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target.get("rope_theta", 10000.0),
        "max_position_embeddings": target["max_position_embeddings"],
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if aux_layer_ids:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def save_tiny_eagle_head(
    path: str,
    target_dir: str,
    *,
    seed: int,
    own_embedding: bool = False,
    own_lm_head: bool = False,
    fc_bias: bool = False,
    nested: bool = False,
) -> str:
    """Saves a random EAGLE-1 head for the tiny Llama at `target_dir`: a one-layer Llama
    `config.json` (with `nested`, vLLM's `model_type: eagle` with the layer's config under
    `model`), `fc` (with a bias: `fc_bias`) and `layers.0.*` with an input norm the head must not
    apply (SafeAILab's heads have none; some conversions keep one); `embed_tokens` and `lm_head`
    only when asked for (else the target's serve). Returns path."""
    import json

    import torch
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    d, vocab, inter = target["hidden_size"], target["vocab_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = d // heads
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.3):
        return torch.randn(*shape, generator=generator) * std

    p = "layers.0."
    tensors = {
        "fc.weight": normal(d, 2 * d, std=0.15),
        f"{p}input_layernorm.weight": 1 + normal(d),
        f"{p}post_attention_layernorm.weight": 1 + normal(d, std=0.1),
        f"{p}self_attn.q_proj.weight": normal(heads * head_dim, d),
        f"{p}self_attn.k_proj.weight": normal(kv_heads * head_dim, d),
        f"{p}self_attn.v_proj.weight": normal(kv_heads * head_dim, d),
        f"{p}self_attn.o_proj.weight": normal(d, heads * head_dim),
        f"{p}mlp.gate_proj.weight": normal(inter, d),
        f"{p}mlp.up_proj.weight": normal(inter, d),
        f"{p}mlp.down_proj.weight": normal(d, inter),
    }
    if fc_bias:
        tensors["fc.bias"] = normal(d, std=0.1)
    if own_embedding:
        tensors["embed_tokens.weight"] = normal(vocab, d)
    if own_lm_head:
        tensors["lm_head.weight"] = normal(vocab, d)
    os.makedirs(path, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(path, "model.safetensors"))
    layer = {
        key: target[key]
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                    "vocab_size", "rms_norm_eps", "max_position_embeddings")
    }  # fmt: skip
    layer.update(
        architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
        tie_word_embeddings=False, rope_theta=target.get("rope_theta", 10000.0), bos_token_id=1,
        eos_token_id=2, torch_dtype="float32",
    )  # fmt: skip
    config = {"model_type": "eagle", "architectures": ["EAGLEModel"], "model": layer} if nested else layer
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path
