# SPDX-License-Identifier: Apache-2.0
"""int8 prepared weights: the preparation names its quantization, the weights cache keeps the
quantized state (a restart restores it, no quantizing again), and a runner serves it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.fp8
import models.int8
from models import PackedKernel, load_model
from models.linear import native_dense_takes_groups
from tests.tiny_models import save_tiny_llama
from tpu_platform.runner import Runner
from tpu_platform.runner_config import RunnerConfig
from tpu_platform.weights.cache import WeightsCache
from tpu_platform.weights.converted import _stored_preparation
from tpu_platform.weights.preparation import Preparation, abstract_prepared
from tpu_platform.weights.prepared import load_prepared, structure_digest

_ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
INT8 = Preparation("bfloat16", quantization="int8")
# int8 kernels packed for the native CPU dense kernel's int8 path, scales beside them
INT8_NATIVE = Preparation("bfloat16", "native", quantization="int8")
# scales per group of 32 inputs (a GGUF's Q8_0 layout): packed only where the native kernel takes them
INT8_G32 = Preparation("bfloat16", quantization="int8-g32")
INT8_G32_NATIVE = Preparation("bfloat16", "native", quantization="int8-g32")
_PREPARATIONS = [INT8, INT8_NATIVE, INT8_G32, INT8_G32_NATIVE]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("int8_llama")), seed=5)


def test_preparation_names_its_quantization():
    assert INT8.name == "bfloat16-none-int8"
    assert Preparation("bfloat16", "native", 2, "int8").name == "bfloat16-native-int8-tp2"
    assert INT8_G32.name == "bfloat16-none-int8-g32" and INT8_G32.int8_group_size == 32
    assert INT8.int8_group_size is None
    stored = (INT8, INT8_G32, Preparation("bfloat16", "native+f32", 4, "int8-g16"), Preparation("float32"))
    for preparation in stored:
        assert _stored_preparation({"preparation": preparation.name}) == preparation
    assert Preparation("bfloat16", quantization="int4-g128").int8_group_size == 128
    for wrong in ("int2", "int8-g0", "int8-g"):
        with pytest.raises(ValueError, match=f"quantization '{wrong}' is not one of"):
            Preparation("bfloat16", quantization=wrong)


@pytest.mark.parametrize("preparation", _PREPARATIONS, ids=lambda p: p.name)
def test_abstract_layout_is_the_loaded_one(tiny_dir, preparation):
    """The structure a cache entry is restored into (built from the config alone) is the one
    quantizing (and packing) the loaded checkpoint gives: int8 kernels, float32 scales, weight
    bytes about halved (grouped: plus a float32 scale per 32 weights)."""
    config, model = load_model(tiny_dir, jnp.bfloat16, on_host=True)
    bf16_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))
    preparation.apply(model)
    _, abstract = abstract_prepared(config, preparation)
    down_proj = model.model.layers[0].mlp.down_proj
    grouped = preparation.int8_group_size is not None
    packed = preparation.packing == "native" and (not grouped or native_dense_takes_groups())
    assert isinstance(down_proj.kernel, PackedKernel) == packed
    assert down_proj.kernel[...].ndim == (3 if packed else 2)
    assert down_proj.kernel_scale[...].shape == ((128 // 32, 64) if grouped else (64,))
    assert structure_digest(abstract) == structure_digest(nnx.state(model))
    leaves = jax.tree.leaves(nnx.state(model))
    assert {leaf.dtype for leaf in leaves} == {
        np.dtype(np.int8),
        np.dtype(np.float32),
        np.dtype(jnp.bfloat16),
    }
    int8_bytes = sum(leaf.nbytes for leaf in leaves)
    embedding = model.model.embed_tokens.embedding[...].nbytes  # stays bfloat16
    assert int8_bytes - embedding < (0.6 if grouped else 0.55) * (bf16_bytes - embedding)


@pytest.mark.parametrize("preparation", _PREPARATIONS, ids=lambda p: p.name)
def test_a_streamed_int8_load_is_the_whole_model_prepared_on_the_host(tiny_dir, preparation):
    """Each kernel quantized (and packed for the native int8 kernel) as it streams equals the
    whole float model loaded, quantized and packed on the host."""
    _, expected = load_model(tiny_dir, jnp.bfloat16, on_host=True)
    preparation.apply(expected)
    _, streamed = load_prepared(tiny_dir, preparation, _ON_DEVICE)
    got_leaves = nnx.to_flat_state(nnx.state(streamed))
    expected_leaves = nnx.to_flat_state(nnx.state(expected))
    assert [p for p, _ in got_leaves] == [p for p, _ in expected_leaves]
    for (path, a), (_, b) in zip(got_leaves, expected_leaves, strict=True):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        assert a.dtype == b.dtype and a.tobytes() == np.ascontiguousarray(b).tobytes(), path
    assert nnx.graphdef(streamed) == nnx.graphdef(expected)


def test_a_float_conversion_serves_int8_when_asked_and_an_int8_one_not_as_float(tiny_dir, tmp_path):
    from tpu_platform.weights.converted import convert, restore_converted

    checkpoint = convert(tiny_dir, str(tmp_path / "float"), Preparation("bfloat16"))
    config, _ = load_model(tiny_dir, jnp.bfloat16, on_host=True)
    model = restore_converted(checkpoint, config, INT8, _ON_DEVICE)
    assert model.model.layers[0].mlp.down_proj.kernel[...].dtype == jnp.int8
    int8 = convert(tiny_dir, str(tmp_path / "int8"), INT8)
    with pytest.raises(ValueError, match="it holds int8 weights: serve it with --quantization"):
        restore_converted(int8, config, Preparation("bfloat16"), _ON_DEVICE)
    assert restore_converted(int8, config, INT8, _ON_DEVICE).lm_head.kernel[...].dtype == jnp.int8


@pytest.mark.parametrize("preparation", [INT8, INT8_NATIVE, INT8_G32], ids=lambda p: p.name)
def test_weights_cache_keeps_the_quantized_weights(tiny_dir, tmp_path, monkeypatch, preparation):
    cache = WeightsCache.for_model(str(tmp_path), tiny_dir, preparation)
    for other in (Preparation("bfloat16"), INT8_G32 if preparation == INT8 else INT8):  # one entry a layout
        assert cache.path != WeightsCache.for_model(str(tmp_path), tiny_dir, other).path
    config, expected = load_model(tiny_dir, jnp.bfloat16, on_host=True)
    preparation.apply(expected)
    cache.store(config, expected)

    for module in (models.int8, models.fp8):  # every quantizer `models.quantization` calls
        quantize = module.quantize

        def abstract_only(kernel, *args, quantize=quantize):  # the restored structure is derived
            if not isinstance(kernel, jax.core.Tracer):  # abstractly: values never
                raise AssertionError("a restore must not quantize weights again")
            return quantize(kernel, *args)

        monkeypatch.setattr(module, "quantize", abstract_only)
    got = cache.load(config, _ON_DEVICE)
    got_leaves = nnx.to_flat_state(nnx.state(got))
    expected_leaves = nnx.to_flat_state(nnx.state(expected))
    assert [p for p, _ in got_leaves] == [p for p, _ in expected_leaves]
    for (path, a), (_, b) in zip(got_leaves, expected_leaves, strict=True):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        assert a.dtype == b.dtype and a.tobytes() == np.ascontiguousarray(b).tobytes(), path


@pytest.mark.slow  # two runners, each preparing or restoring a whole model
def test_runner_serves_int8_from_the_weights_cache(tiny_dir, tmp_path):
    """A runner asked for vLLM's int8 method prepares int8 weights, stores them, and a second
    runner restores them from the cache."""

    def runner():
        config = RunnerConfig(
            model_path=tiny_dir, dtype="bfloat16", max_model_len=64, max_num_seqs=2,
            max_num_batched_tokens=16, page_size=16, native_dense=False, cache_dir=str(tmp_path),
            load_format="npcache", quantization="int8_per_channel_weight_only",
        )  # fmt: skip
        r = Runner(config)
        r.load_model()
        return r

    first = runner()
    kernel = first.state["model"]["layers"][0]["mlp"]["down_proj"]["kernel"]
    assert kernel.get_value().dtype == jnp.int8
    second = runner()
    first_leaves, second_leaves = jax.tree.leaves(first.state), jax.tree.leaves(second.state)
    assert len(first_leaves) == len(second_leaves)
    for a, b in zip(first_leaves, second_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="quantization 'bitsandbytes' is not supported; supported"):
        RunnerConfig(model_path=tiny_dir, quantization="bitsandbytes")
