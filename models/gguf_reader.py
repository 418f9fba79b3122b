# SPDX-License-Identifier: Apache-2.0
"""GGUF checkpoints (llama.cpp format): HF config and HF-named float32 tensors.

The file is read by `gguf_file.read_gguf`; quantized tensors are dequantized with the `gguf`
package. llama.cpp stores the rows of
`attn_q`/`attn_k` permuted for its interleaved RoPE; they are permuted back to the HF
(rotate-half) order here, so the result is what an HF checkpoint of the same model holds.

Serving int8 weights (`models.quantization`), the Q8_0 linear weights come as they are instead
(`int8_q8_0=True`): Q8_0 stores each row in blocks of `Q8_0_BLOCK` (32) int8 values with one
float16 scale a block, so a weight `[out, in]` is yielded as `<name>` (its int8 values `[out,
in]`, rows in HF order) and `<name>_scale` (its block scales `[out, in / 32]` in float32, exact),
the pair a compressed-tensors `group` checkpoint holds: loaded as an int8 kernel `[in, out]` with
grouped scales `[in / 32, out]` (`models.int8`), nothing re-quantized.

A file whose every projection weight is 4-bit (`Q4_0`, `Q4_1`, `Q4_K`: `q4_linear_weights`)
serves them as they are too (`int4_q4=True`): each block of 32 inputs of a row is 4-bit unsigned
values `u` with a scale `d` and an offset, mapped exactly onto int4 values `u - 8`, a float32
scale and a float32 offset per block (`models.int4`'s affine layout, `w = q * s + m`): Q4_0's `w
= d * (u - 8)` (offset 0), Q4_1's `w = d * u + min` (offset `min + 8 d`), Q4_K's super-blocks of
256 with a 6-bit scale and minimum per 32 (`w = d * sc * u - dmin * mn`: scale `d * sc`, offset
`8 d sc - dmin mn`). Yielded as `<name>`, `<name>_scale` and `<name>_offset` (`[out, in / 32]`).
A file that mixes 4-bit projections with other types (a Q4_K_M file's Q6_K ones) loads as float
as before; the embedding (and a tied head) loads as float.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from models.gguf_file import GgufFile, read_gguf
from models.int4 import INT4_DTYPE
from models.int8 import SCALE_DTYPE

_Q8_0 = 8  # GGMLQuantizationType.Q8_0
Q8_0_BLOCK = 32  # inputs a Q8_0 scale covers (ggml's QK8_0)
_Q4_0, _Q4_1, _Q4_K = 2, 3, 12  # GGMLQuantizationType.Q4_0, Q4_1, Q4_K
Q4_TYPES = (_Q4_0, _Q4_1, _Q4_K)
Q4_BLOCK = 32  # inputs a 4-bit scale and offset cover (a Q4_K sub-block)
_Q4_K_BLOCK = 256  # inputs of a Q4_K super-block (ggml's QK_K)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM"}


def _opened(source: str | GgufFile) -> GgufFile:
    return source if isinstance(source, GgufFile) else read_gguf(source)


def hf_name(gguf_name: str) -> str:
    """The HF checkpoint name of a GGUF tensor name, or a ValueError."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name")


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaved-RoPE row order of a q/k projection `[out, in]`."""
    out = w.shape[0]
    head_dim = out // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def hf_config(source: str | GgufFile) -> dict[str, Any]:
    """An HF `config.json` dict built from the GGUF metadata (a path, or a file already read)."""
    gguf = _opened(source)
    arch = gguf.field("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(_SUPPORTED_ARCHS)}"
        )
    num_heads = int(gguf.field(f"{arch}.attention.head_count"))
    hidden = int(gguf.field(f"{arch}.embedding_length"))
    names = {t.name for t in gguf.tensors}
    return {
        "architectures": [_SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": len(gguf.field("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": int(gguf.field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(gguf.field(f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(gguf.field(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": hidden // num_heads,
        "rms_norm_eps": float(gguf.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(gguf.field(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf.field(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.field("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def q8_0_linear_weights(source: str | GgufFile) -> list[str]:
    """The HF names of the file's linear weights (projections and `lm_head`) stored as Q8_0."""
    names = [hf_name(t.name) for t in _opened(source).tensors if t.ggml_type == _Q8_0]
    return [n for n in names if n.endswith("_proj.weight") or n == "lm_head.weight"]


def q4_linear_weights(source: str | GgufFile) -> list[str]:
    """The HF names of the file's projection weights when every one of them is 4-bit (Q4_0,
    Q4_1, Q4_K), else none (see the module docstring)."""
    linear = [(hf_name(t.name), t.ggml_type) for t in _opened(source).tensors]
    linear = [(n, kind) for n, kind in linear if n.endswith("_proj.weight")]
    if not linear or any(kind not in Q4_TYPES for _, kind in linear):
        return []
    return [n for n, _ in linear]


def q4_float16_blocks(source: str | GgufFile) -> bool:
    """Whether the file's 4-bit projections (`q4_linear_weights`) are all Q4_0 or Q4_1: each
    block's scale d and base (the weight of u = 0: its minimum, Q4_0's -8 d) are float16, which
    the native CPU int4 kernel reads as they are (`pallas_kernels.cpu.float16_scales`); Q4_K's
    scales d sc are not."""
    kinds = {t.ggml_type for t in _opened(source).tensors if hf_name(t.name).endswith("_proj.weight")}
    return bool(q4_linear_weights(source)) and kinds <= {_Q4_0, _Q4_1}


def q8_0_embedding(source: str | GgufFile) -> bool:
    """Whether the file's token embedding is Q8_0 (`q8_0_embedding_blocks`)."""
    return any(t.name == "token_embd.weight" and t.ggml_type == _Q8_0 for t in _opened(source).tensors)


def q8_0_embedding_blocks(source: str | GgufFile) -> tuple[np.ndarray, np.ndarray] | None:
    """The file's token embedding's Q8_0 blocks as they are: int8 values `[V, D]` and float16
    scales `[V, D / 32]` (a tied head's int8 copy, `[D, V]` transposed, in the same groups of
    32 as `models.quantization.quantize_tied_head_int8` makes it); None if it is not Q8_0."""
    for tensor in _opened(source).tensors:
        if tensor.name == "token_embd.weight" and tensor.ggml_type == _Q8_0:
            return q8_0_blocks(tensor.data, np.float16)
    return None


def iter_hf_tensors(
    source: str | GgufFile,
    *,
    int8_q8_0: bool = False,
    int4_q4: bool = False,
    q8_0_embedding: tuple[np.ndarray, np.ndarray] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(hf_name, float32 array)` for every tensor of the GGUF file (a path, or a file
    already read); with `int8_q8_0`, each of `q8_0_linear_weights` as its int8 values and block
    scales; with `int4_q4`, each of `q4_linear_weights` as its int4 values, block scales and
    offsets (see the module docstring). `q8_0_embedding`: the file's embedding blocks, read
    already (`q8_0_embedding_blocks`), whose values the embedding is made from, not read again."""
    from gguf.quants import dequantize

    gguf = _opened(source)
    arch = gguf.field("general.architecture")
    num_heads = int(gguf.field(f"{arch}.attention.head_count"))
    num_kv_heads = int(gguf.field(f"{arch}.attention.head_count_kv", num_heads))
    int8_names = set(q8_0_linear_weights(gguf)) if int8_q8_0 else set()
    int4_names = set(q4_linear_weights(gguf)) if int4_q4 else set()
    for tensor in gguf.tensors:
        name = hf_name(tensor.name)
        if q8_0_embedding is not None and tensor.name == "token_embd.weight":
            yield name, q8_0_values(*q8_0_embedding)
            continue
        if name in int4_names:
            q, scale, offset = q4_blocks(tensor.data, int(tensor.ggml_type))
            for suffix, value in (("", q), ("_scale", scale), ("_offset", offset)):
                yield name + suffix, _hf_rows(name + suffix, value, num_heads, num_kv_heads)
            continue
        if int8_q8_0 and tensor.ggml_type == _Q8_0 and name in int8_names:
            q, scale = q8_0_blocks(tensor.data)
            yield name, _hf_rows(name, q, num_heads, num_kv_heads)
            yield f"{name}_scale", _hf_rows(name, scale, num_heads, num_kv_heads)
            continue
        array = np.asarray(dequantize(tensor.data, tensor.ggml_type), dtype=np.float32)
        yield name, _hf_rows(name, array, num_heads, num_kv_heads)


def _hf_rows(name: str, array: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """A tensor's rows in HF order: q and k projections' (and their per-row scales') unpermuted."""
    if name.endswith(("q_proj.weight", "q_proj.bias", "q_proj.weight_scale", "q_proj.weight_offset")):
        return unpermute_rope_rows(array, num_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias", "k_proj.weight_scale", "k_proj.weight_offset")):
        return unpermute_rope_rows(array, num_kv_heads)
    return array


def q8_0_blocks(data: np.ndarray, scale_dtype=SCALE_DTYPE) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's raw bytes `[rows, blocks * 34]` (each block a float16 scale, then 32 int8
    values) -> its int8 values `[rows, blocks * 32]` and scales `[rows, blocks]` (float32, or
    `scale_dtype`: float16 keeps the file's own)."""
    raw = np.ascontiguousarray(data, np.uint8)
    rows = raw.reshape(-1, raw.shape[-1]).shape[0]
    blocks = raw.reshape(rows, -1, 2 + Q8_0_BLOCK)
    scale = blocks[..., :2].copy().view("<f2")[..., 0].astype(scale_dtype)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return q, scale


def q8_0_values(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Q8_0 blocks' float32 weights `[rows, in]` from their int8 values `[rows, in]` and scales
    `[rows, in / 32]`: each value times its block's scale, as the `gguf` package dequantizes them."""
    rows = q.shape[0]
    blocks = q.reshape(rows, -1, Q8_0_BLOCK).astype(np.float32) * scale.astype(np.float32)[..., None]
    return blocks.reshape(q.shape)


def q4_blocks(data: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0, Q4_1 or Q4_K tensor's raw bytes `[rows, bytes]` -> its int4 values `[rows, in]`
    and float32 scales and offsets `[rows, in / 32]`: `w = q * scale + offset` per block of 32
    inputs, exactly the file's weights (see the module docstring)."""
    raw = np.ascontiguousarray(data, np.uint8)
    rows = raw.reshape(-1, raw.shape[-1]).shape[0]
    if ggml_type == _Q4_K:
        u, scale, low = _q4_k_blocks(raw.reshape(rows, -1, 144))
    else:
        header = 2 if ggml_type == _Q4_0 else 4
        blocks = raw.reshape(rows, -1, header + Q4_BLOCK // 2)
        halves = blocks[..., :header].copy().view("<f2").astype(SCALE_DTYPE)  # d (and min)
        scale = halves[..., 0]
        low = -8 * scale if ggml_type == _Q4_0 else halves[..., 1]  # the weight of u = 0
        qs = blocks[..., header:]
        u = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # a block's first 16 values, then the rest
    q = (u.reshape(rows, -1).astype(np.int8) - 8).astype(INT4_DTYPE)
    return q, scale, (low + 8 * scale).astype(SCALE_DTYPE)


def _q4_k_blocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks `[rows, n, 144]` (d, dmin float16; 12 bytes of eight 6-bit scales and
    minimums; 128 bytes of values, each 32 holding sub-blocks 2j (low nibbles) and 2j + 1) ->
    unsigned values `[rows, n * 8, 32]`, scales `d * sc` and `-dmin * mn` `[rows, n * 8]`."""
    rows, count, _ = blocks.shape
    d, dmin = (blocks[..., i : i + 2].copy().view("<f2")[..., 0].astype(SCALE_DTYPE) for i in (0, 2))
    packed = blocks[..., 4:16]
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([first & 0x3F, (rest & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mn = np.concatenate([second & 0x3F, (rest >> 4) | ((second >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, count, 4, 1, 32)
    u = np.concatenate([qs & 0xF, qs >> 4], axis=-2).reshape(rows, count * 8, Q4_BLOCK)
    scale = (d[..., None] * sc.astype(SCALE_DTYPE)).reshape(rows, -1)
    low = -(dmin[..., None] * mn.astype(SCALE_DTYPE)).reshape(rows, -1)
    return u, scale, low
