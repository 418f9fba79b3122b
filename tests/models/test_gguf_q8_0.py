# SPDX-License-Identifier: Apache-2.0
"""A GGUF's Q8_0 weights served as int8 as they are (`gguf_reader`, int8 loads): a tiny Llama
written here with the `gguf` package's writer and Q8_0 quantizer, loaded with int8 weights whose
scales are the file's own blocks (`[in / 32, out]`, nothing re-quantized), against the `gguf`
package's dequantization and the float model of the dequantized Q8_0 values (the file's own
meaning)."""

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from models import ModelConfig, load_model
from models.gguf_reader import (
    Q8_0_BLOCK,
    hf_config,
    hf_name,
    iter_hf_tensors,
    q8_0_linear_weights,
    unpermute_rope_rows,
)
from models.int8 import dequantize
from tests.models.tiny_checkpoints import caches, prompts, run_step
from tests.tiny_models import save_tiny_llama
from tpu_platform.weights.preparation import Preparation, int8_quantization
from tpu_platform.weights.prepared import load_prepared

_ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved-RoPE row order of a q/k projection (its converter's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _q8_0(w: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def write_q8_0_gguf(source: str, out: str, quantize=_q8_0, *, q8_0_embedding: bool = False) -> None:
    """`source` (a tiny HF Llama) as a GGUF at `out/model.gguf` and its config: linear weights
    Q8_0 (the `gguf` package's quantizer; or as `quantize(w)` gives them: raw blocks and their
    type), the embedding (Q8_0 with `q8_0_embedding`, as the embedded model's) and norms float32."""
    config = ModelConfig.from_pretrained(source)
    os.makedirs(out)
    writer = gguf.GGUFWriter(os.path.join(out, "model.gguf"), "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    with safe_open(os.path.join(source, "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            w = f.get_tensor(name).astype(np.float32)
            if name == "model.embed_tokens.weight":
                blocks, kind = _q8_0(w) if q8_0_embedding else (w, None)
                writer.add_tensor("token_embd.weight", blocks, raw_dtype=kind)
                continue
            if name == "model.norm.weight":
                writer.add_tensor("output_norm.weight", w)
                continue
            if name == "lm_head.weight":
                gguf_name = "output.weight"
            else:
                layer, rest = name.removeprefix("model.layers.").split(".", 1)
                gguf_name = f"blk.{layer}.{_LAYER[rest]}"
                if rest == "self_attn.q_proj.weight":
                    w = _permute(w, config.num_heads)
                elif rest == "self_attn.k_proj.weight":
                    w = _permute(w, config.num_kv_heads)
            if w.ndim == 1:
                writer.add_tensor(gguf_name, w)
            else:
                blocks, kind = quantize(w)
                writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(os.path.join(out, "config.json"), "w") as f:  # as `vllm-xla model-dir` writes it
        json.dump(hf_config(os.path.join(out, "model.gguf")), f)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("q8_0")
    source = save_tiny_llama(str(scratch / "source"), seed=9)
    write_q8_0_gguf(source, str(scratch / "gguf"))
    return str(scratch / "gguf")


def _arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def _logits(model: nnx.Module, config: ModelConfig) -> np.ndarray:
    (ids,) = prompts([24], seed=3)
    logits, _ = run_step(model, caches(config), [ids], [0], [[1, 2]])
    return np.asarray(logits, np.float64)


def test_q8_0_tensors_come_as_their_int8_values_and_block_scales(gguf_dir):
    """q * s of each yielded Q8_0 weight is the `gguf` package's dequantized tensor, exactly (rows
    in HF order: q and k unpermuted, their scales with them)."""
    path = os.path.join(gguf_dir, "model.gguf")
    floats = dict(iter_hf_tensors(path))
    tensors = dict(iter_hf_tensors(path, int8_q8_0=True))
    names = q8_0_linear_weights(path)
    assert len(names) == 7 * 2 + 1  # seven projections a layer, lm_head
    reader = gguf.GGUFReader(path)
    by_name = {hf_name(t.name): t for t in reader.tensors}
    for name in names:
        q, scale = tensors[name], tensors[f"{name}_scale"]
        out, inputs = floats[name].shape
        assert q.dtype == np.int8 and q.shape == (out, inputs), name
        assert scale.dtype == np.float32 and scale.shape == (out, inputs // Q8_0_BLOCK), name
        package = gguf.quants.dequantize(by_name[name].data, by_name[name].tensor_type)
        if name.endswith("q_proj.weight"):
            package = unpermute_rope_rows(package, 4)
        elif name.endswith("k_proj.weight"):
            package = unpermute_rope_rows(package, 2)
        grouped = (q.reshape(out, -1, Q8_0_BLOCK).astype(np.float32) * scale[..., None]).reshape(out, inputs)
        np.testing.assert_array_equal(grouped, package, err_msg=name)
        np.testing.assert_array_equal(floats[name], package, err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q8_0_kernels_load_as_they_are(gguf_dir, dtype):
    """Each Q8_0 kernel (fused ones too) is int8 with one scale per block of 32 inputs of each
    column, and dequantizes to exactly the float32 load's kernel (whatever the model's dtype)."""
    assert int8_quantization(gguf_dir) == "int8-g32"
    config, reference = load_model(gguf_dir, jnp.float32, on_host=True)  # dequantized, float32
    expected = _arrays(reference)
    _, model = load_prepared(gguf_dir, Preparation(dtype, quantization="int8-g32"), _ON_DEVICE)
    got = _arrays(model)
    kernels = [n for n in got if n.endswith(".kernel") and got[n].dtype == np.int8]
    assert len(kernels) == 4 * config.num_layers + 1  # qkv, o, gate_up, down a layer, lm_head
    for name in kernels:
        inputs, out = got[name].shape
        assert got[f"{name}_scale"].shape == (inputs // 32, out), name
        np.testing.assert_array_equal(
            dequantize(got[name], got[f"{name}_scale"]), expected[name], err_msg=name
        )
    assert got["model.embed_tokens.embedding"].dtype == jnp.dtype(dtype)  # the table stays float


def test_int8_logits_equal_the_dequantized_q8_0_model(gguf_dir):
    config, reference = load_model(gguf_dir, jnp.float32)
    _, model = load_prepared(gguf_dir, Preparation("float32", quantization="int8-g32"), _ON_DEVICE)
    expected, got = _logits(reference, config), _logits(model, config)
    # The int8 model's weights are the file's own values: only the order of float32 sums differs.
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a second Q8_0 model (fast: its int8 logits against the dequantized one)
def test_a_tied_head_is_quantized_in_the_same_groups(tmp_path):
    """A GGUF without `output.weight` (tied head, float embedding table): its head's `[D, V]`
    copy is quantized at load in groups of 32 inputs, like the Q8_0 kernels beside it, and the
    model computes the float model of its dequantized weights."""
    source = save_tiny_llama(str(tmp_path / "source"), seed=4, tie_word_embeddings=True)
    write_q8_0_gguf(source, str(tmp_path / "gguf"))
    path = str(tmp_path / "gguf")
    config, reference = load_model(path, jnp.float32)
    assert config.tie_word_embeddings
    _, model = load_prepared(path, Preparation("float32", quantization=int8_quantization(path)), _ON_DEVICE)
    head = model.model.embed_tokens
    assert head.head_kernel[...].dtype == jnp.int8 and head.head_scale[...].shape == (64 // 32, 384)
    twin = _arrays(model)
    for name in [n for n in twin if n.endswith(("kernel_scale", "head_scale"))]:
        kernel = (
            name.removesuffix("_scale") if name.endswith("kernel_scale") else name.replace("scale", "kernel")
        )
        twin[kernel] = dequantize(twin[kernel], twin.pop(name))
    nnx.update(reference, _state_of(reference, twin))
    np.testing.assert_allclose(_logits(model, config), _logits(reference, config), rtol=1e-4, atol=1e-4)


def test_a_per_channel_preparation_of_q8_0_weights_is_refused_by_name(gguf_dir):
    with pytest.raises(ValueError, match=r"its layout \(per channel or grouped"):
        load_prepared(gguf_dir, Preparation("float32", quantization="int8"), _ON_DEVICE)


def _state_of(model: nnx.Module, arrays: dict[str, np.ndarray]) -> nnx.State:
    """`model`'s state with each array replaced by `arrays`' (by dotted path)."""
    state = nnx.state(model)
    for key, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(arrays[".".join(map(str, key))]))
    return state
