# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla convert --quantization int8_per_channel_weight_only`: the conversion holds int8
kernels and scales, the ones an int8 load streams; a compressed-tensors source stays int8.
(Restoring at other TP sizes: `tests/tpu_platform/test_int8_tensor_parallel.py`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ModelConfig
from plugin_shim.cli import main
from tests.models.test_compressed_tensors import write_compressed
from tests.tiny_models import save_tiny_llama
from tpu_platform.weights.converted import converted_weights, restore_converted
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import load_prepared, read_metadata

_ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
_INT8 = Preparation("bfloat16", quantization="int8")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("int8_convert_source")), seed=8)


def _arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, array in got.items():
        assert array.dtype == expected[name].dtype and array.tobytes() == expected[name].tobytes(), name


def test_an_int8_conversion_holds_the_streamed_int8_weights(source, tmp_path, capsys):
    out = str(tmp_path / "int8")
    args = ["convert", source, out, "--dtype", "bfloat16", "--quantization", "int8_per_channel_weight_only"]
    assert main(args) == 0
    assert "serve the model directory" in capsys.readouterr().out
    checkpoint = converted_weights(out)
    assert read_metadata(checkpoint)["preparation"] == "bfloat16-none-int8"
    config = ModelConfig.from_pretrained(out)
    restored = _arrays(restore_converted(checkpoint, config, _INT8, _ON_DEVICE))
    assert restored["model.layers.0.self_attn.qkv_proj.kernel"].dtype == np.int8
    assert restored["model.layers.0.self_attn.qkv_proj.kernel_scale"].dtype == np.float32
    assert restored["lm_head.kernel"].dtype == np.int8
    assert restored["model.embed_tokens.embedding"].dtype == jnp.bfloat16
    _, streamed = load_prepared(source, _INT8, _ON_DEVICE)
    _assert_same(restored, _arrays(streamed))
    with pytest.raises(ValueError, match="it holds int8 weights: serve it with --quantization"):
        restore_converted(checkpoint, config, Preparation("bfloat16"), _ON_DEVICE)


def test_a_compressed_tensors_source_converts_as_int8_without_the_option(source, tmp_path):
    compressed = str(tmp_path / "compressed")
    write_compressed(source, compressed, fmt="pack-quantized", strategy="channel")
    out = str(tmp_path / "out")
    assert main(["convert", compressed, out, "--dtype", "bfloat16"]) == 0
    checkpoint = converted_weights(out)
    assert read_metadata(checkpoint)["preparation"] == "bfloat16-none-int8"
    restored = _arrays(restore_converted(checkpoint, ModelConfig.from_pretrained(out), _INT8, _ON_DEVICE))
    _, streamed = load_prepared(compressed, _INT8, _ON_DEVICE)
    _assert_same(restored, _arrays(streamed))


def test_an_unknown_quantization_is_refused(source, tmp_path):
    with pytest.raises(SystemExit):
        main(["convert", source, str(tmp_path / "x"), "--quantization", "fp8"])
