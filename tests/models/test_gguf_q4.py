# SPDX-License-Identifier: Apache-2.0
"""A GGUF whose projections are all 4-bit (Q4_0, Q4_1, Q4_K: `gguf_q4_blocks`) served as int4
values with a scale and an offset per block of 32 inputs (`gguf_reader.q4_blocks`,
`models.int4`'s affine layout): each block maps exactly onto the `gguf` package's
dequantization, and the served model computes the float model of the dequantized weights. A
file mixing 4-bit projections with another type loads as float, as before, and so does an
all-4-bit one when a `quantization` is asked (then quantized so)."""

import dataclasses
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import int4, load_model
from models.checkpoint_kinds import gguf_4bit_quantization, gguf_float16_scales, gguf_q8_0_embedding
from models.gguf_reader import Q4_BLOCK, hf_name, iter_hf_tensors, q4_linear_weights, unpermute_rope_rows
from models.linear import Int4Bases
from tests.models.counted_reads import counting_gguf_reads, gguf_tensor_bytes
from tests.models.gguf_q4_blocks import Q4_TYPES, quantizer
from tests.models.test_gguf_q8_0 import _arrays, _logits, write_q8_0_gguf
from tests.models.tiny_checkpoints import caches, prompts, run_step
from tests.tiny_models import save_tiny_llama
from tpu_platform.weights.preparation import Preparation, int8_quantization
from tpu_platform.weights.prepared import (
    UnusableCheckpoint,
    load_prepared,
    metadata_for,
    restore_prepared,
    save_prepared,
)

_ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
_WIDTHS = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama whose projections' inputs are whole Q4_K super-blocks (256)."""
    return save_tiny_llama(str(tmp_path_factory.mktemp("q4") / "source"), seed=5, **_WIDTHS)


@pytest.fixture(scope="module", params=Q4_TYPES, ids=lambda kind: kind.name)
def q4_dir(request, source, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(request.param.name) / "gguf")
    write_q8_0_gguf(source, out, quantize=quantizer(request.param))
    return out


def test_q4_blocks_are_the_files_weights_exactly(q4_dir):
    """q * scale + offset of each yielded 4-bit weight is the `gguf` package's dequantized tensor
    (rows in HF order: q and k unpermuted, their scales and offsets with them)."""
    path = os.path.join(q4_dir, "model.gguf")
    tensors = dict(iter_hf_tensors(path, int4_q4=True))
    names = q4_linear_weights(path)
    assert len(names) == 7 * 2  # seven projections a layer; lm_head loads as float
    by_name = {hf_name(t.name): t for t in gguf.GGUFReader(path).tensors}
    for name in names:
        q, scale, offset = tensors[name], tensors[f"{name}_scale"], tensors[f"{name}_offset"]
        out, inputs = q.shape
        assert int4.is_int4(q.dtype) and scale.shape == offset.shape == (out, inputs // Q4_BLOCK), name
        package = gguf.quants.dequantize(by_name[name].data, by_name[name].tensor_type)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            package = unpermute_rope_rows(package, 4 if "q_proj" in name else 2)
        blocks = q.reshape(out, -1, Q4_BLOCK).astype(np.float32) * scale[..., None] + offset[..., None]
        np.testing.assert_allclose(blocks.reshape(out, inputs), package, rtol=0, atol=1e-6, err_msg=name)


def test_q4_gguf_serves_int4_with_offsets_computing_the_dequantized_model(q4_dir):
    assert gguf_4bit_quantization(q4_dir) == "int4z-g32"  # served so when nothing is asked
    assert int8_quantization(q4_dir, "int8_per_channel_weight_only") == "int8"  # asked: as before
    config, reference = load_model(q4_dir, jnp.float32)  # dequantized by the `gguf` package
    _, model = load_prepared(q4_dir, Preparation("float32", quantization="int4z-g32"), _ON_DEVICE)
    got = _arrays(model)
    kernels = [n for n in got if n.endswith(".kernel") and got[n].dtype == int4.held_dtype()]
    assert len(kernels) == 4 * config.num_layers  # qkv, o, gate_up, down; lm_head stays float
    for name in kernels:
        inputs, out = got[name].shape
        assert got[f"{name}_scale"].shape == got[f"{name}_offset"].shape == (inputs // 32, out), name
    assert got["lm_head.kernel"].dtype == np.float32
    # The file's own weights; the sums run in another order (values times scales, then the
    # offsets on each block's input sum), so float32 rounding differs slightly.
    np.testing.assert_allclose(_logits(model, config), _logits(reference, config), rtol=1e-3, atol=1e-3)


def test_q4_gguf_on_the_native_int4_kernel_computes_the_dequantized_model(q4_dir, dense_kernels):
    """Prepared for the native CPU kernels, the 4-bit projections stream in packed two a byte for
    the int4 kernel (`[out / 16, in / 8, 16]` uint32), scales and offsets beside them, and the
    model still computes the float model of the file's dequantized weights."""
    config, reference = load_model(q4_dir, jnp.float32)
    preparation = Preparation("float32", packing="native+f32", quantization="int4z-g32")
    _, model = load_prepared(q4_dir, preparation, _ON_DEVICE)
    got = _arrays(model)
    kernels = [n for n in got if n.endswith(".kernel") and got[n].dtype == np.uint32]
    assert len(kernels) == 4 * config.num_layers  # qkv, o, gate_up, down; lm_head float32 panels
    for name in kernels:
        panels, words, width = got[name].shape
        assert width == 16 and got[f"{name}_offset"].shape == (words * 8 // 32, panels * 16), name
    np.testing.assert_allclose(_logits(model, config), _logits(reference, config), rtol=1e-3, atol=1e-3)


@pytest.mark.slow  # a load and a step per type (fast: the same files served and on the native kernel)
def test_q4_0_and_q4_1_stream_in_with_their_float16_scales_and_bases(q4_dir, dense_kernels, tmp_path):
    """Prepared with float16 scales (Q4_0 and Q4_1 files: each block's d and minimum are
    float16), every packed projection holds its scales and bases (`Int4Bases`) in float16, and
    the model computes bit for bit what it computes from the float32 scales and offsets, on a
    prefill and on a few rows, and so does its prepared-weights checkpoint restored (the float32
    preparation's name refuses it); Q4_K's scales d sc are not float16 and are refused by name."""
    plain = Preparation("bfloat16", "native", quantization="int4z-g32")
    half = dataclasses.replace(plain, float16_scales=True)
    if "Q4_K" in q4_dir:
        assert not gguf_float16_scales(q4_dir)
        with pytest.raises(ValueError, match="float16 would round"):
            load_prepared(q4_dir, half, _ON_DEVICE)
        return
    assert gguf_float16_scales(q4_dir)
    config, model = load_prepared(q4_dir, half, _ON_DEVICE)
    _, float32 = load_prepared(q4_dir, plain, _ON_DEVICE)
    got = _arrays(model)
    kernels = [n for n in got if n.endswith(".kernel") and got[n].dtype == np.uint32]
    assert len(kernels) == 4 * config.num_layers
    assert all(got[f"{n}_scale"].dtype == got[f"{n}_offset"].dtype == np.float16 for n in kernels)
    halved = [m for _, m in nnx.iter_modules(model) if isinstance(getattr(m, "kernel_offset", 0), Int4Bases)]
    assert len(halved) == len(kernels)
    save_prepared(str(tmp_path / "ckpt"), nnx.state(model), metadata_for(config, half, nnx.state(model)))
    restored = restore_prepared(str(tmp_path / "ckpt"), config, half, _ON_DEVICE)
    with pytest.raises(UnusableCheckpoint, match="f16scales"):
        restore_prepared(str(tmp_path / "ckpt"), config, plain, _ON_DEVICE)
    for ids in prompts([24, 3], seed=3):  # a prefill's rows, and a few (the VNNI path's)
        logits = [run_step(m, caches(config), [ids], [0], [[1, 2]])[0] for m in (model, float32, restored)]
        np.testing.assert_array_equal(logits[0], logits[1])
        np.testing.assert_array_equal(logits[0], logits[2])


@pytest.mark.slow  # 7 s: a load and a step (the fast ones: test_cpu_dense_int8_float16.py)
def test_a_tied_q8_0_embedding_streams_its_head_scales_in_float16(tmp_path, dense_kernels):
    """A Q4_1 file with a tied Q8_0 embedding (the embedded model's layout), prepared with float16
    head scales: the head's packed int8 copy is the file's own blocks, each block's float16 d
    and values, and the model computes bit for bit what float32 copies of those scales give."""
    from models.layers import HeadCopy
    from pallas_kernels.cpu.dense_int8 import unpack_dense_kernel_int8

    source = save_tiny_llama(str(tmp_path / "source"), seed=6, tie_word_embeddings=True, **_WIDTHS)
    path = str(tmp_path / "gguf")
    write_q8_0_gguf(source, path, quantize=quantizer(gguf.GGMLQuantizationType.Q4_1), q8_0_embedding=True)
    assert gguf_q8_0_embedding(path) and not gguf_q8_0_embedding(source)
    plain = Preparation("bfloat16", "native", quantization="int4z-g32", float16_scales=True)
    half = dataclasses.replace(plain, float16_head_scales=True)
    assert half.name.endswith("-f16scales-f16head")
    with counting_gguf_reads() as read:  # each tensor once: the embedding and its head from one read
        config, model = load_prepared(path, half, _ON_DEVICE)
    assert read == gguf_tensor_bytes(os.path.join(path, "model.gguf"))
    head = model.model.embed_tokens
    assert head.head_scale[...].dtype == np.float16
    table = gguf.GGUFReader(os.path.join(path, "model.gguf")).get_tensor(0)
    assert table.name == "token_embd.weight"
    blocks = np.asarray(table.data).reshape(config.vocab_size, -1, 34)
    np.testing.assert_array_equal(head.head_scale[...], blocks[..., :2].copy().view("<f2")[..., 0].T)
    values = blocks[..., 2:].copy().view(np.int8).reshape(config.vocab_size, -1)
    np.testing.assert_array_equal(unpack_dense_kernel_int8(head.head_kernel[...]), values.T)
    dequantized = gguf.quants.dequantize(table.data, table.tensor_type).astype(jnp.bfloat16)
    np.testing.assert_array_equal(head.embedding[...], dequantized)  # made from the same blocks
    widened = nnx.clone(model)
    widened.model.embed_tokens.head_scale = HeadCopy(np.asarray(head.head_scale[...], np.float32))
    (ids,) = prompts([3], seed=3)  # a few rows (the kernel's tests take the others)
    logits = [run_step(m, caches(config), [ids], [0], [[1, 2]])[0] for m in (model, widened)]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_a_file_mixing_q4_with_other_types_loads_as_float(source, tmp_path):
    def mixed(w: np.ndarray):
        kind = gguf.GGMLQuantizationType.Q8_0 if w.shape[0] == 128 else gguf.GGMLQuantizationType.Q4_1
        return gguf.quants.quantize(w, kind), kind  # k and v projections Q8_0

    write_q8_0_gguf(source, str(tmp_path / "gguf"), quantize=mixed)
    assert gguf_4bit_quantization(str(tmp_path / "gguf")) is None
    assert q4_linear_weights(str(tmp_path / "gguf" / "model.gguf")) == []
