# SPDX-License-Identifier: Apache-2.0
"""Prepared-weights checkpoints restored onto other shardings, and converted model directories."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ModelConfig, PackedKernel, load_model
from tests.tiny_models import save_tiny_llama
from tests.xla_flags import with_host_devices
from tpu_platform.weights.converted import PREPARED_DIR, convert, converted_weights, restore_converted
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import load_prepared

_ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("prepared_llama")), seed=5)


@pytest.mark.slow  # 8 simulated devices in a subprocess
def test_a_checkpoint_saved_two_way_restores_one_way_and_four_way_bit_for_bit(tiny_dir, tmp_path):
    env = {**os.environ, "XLA_FLAGS": with_host_devices(8), "JAX_PLATFORMS": "cpu"}
    worker = [sys.executable, "-m", "tests.tpu_platform.reshard_worker", tiny_dir, str(tmp_path / "ckpt")]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    assert len(report) == 2 * len([k for k in report if k.startswith("1:")]) > 0
    for key, array in report.items():
        ways = key.split(":")[0]
        assert array["equal"], key  # bit for bit what the host prepared
        sharded = array["spec"] and array["spec"][-1] == "model"
        if ways == "1":
            assert array["devices"] == 1 and array["shard_bytes"] == [array["bytes"]], key
        elif sharded:  # each of the 4 devices holds a quarter of the weight
            assert array["devices"] == 4 and array["shard_bytes"] == [array["bytes"] // 4], key
        else:
            assert array["shard_bytes"] == [array["bytes"]], key  # a norm: replicated
    assert report["4:model.layers.0.self_attn.qkv_proj.kernel"]["spec"] == [None, "model"]
    assert report["4:model.norm.weight"]["spec"] == []


@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prepared_converted") / "model")
    convert(tiny_dir, out, Preparation("bfloat16"))
    return out


def _restore(converted_dir, preparation):
    config = ModelConfig.from_pretrained(converted_dir)
    return restore_converted(converted_weights(converted_dir), config, preparation, _ON_DEVICE)


def test_a_conversion_restores_the_prepared_weights_and_packs_where_the_runner_packs(
    tiny_dir, converted, request
):
    _, expected = load_model(tiny_dir, jnp.bfloat16, on_host=True)
    got = _restore(converted, Preparation("bfloat16"))
    expected_leaves = dict(nnx.to_flat_state(nnx.state(expected)))
    for path, var in nnx.to_flat_state(nnx.state(got)):
        assert (
            np.asarray(var.get_value()).tobytes() == np.asarray(expected_leaves[path].get_value()).tobytes()
        )
    request.getfixturevalue("dense_kernels")  # packing needs a CPU with the native dense kernel
    packed = _restore(converted, Preparation("bfloat16", "native"))
    Preparation("bfloat16", "native").apply(expected)
    assert nnx.graphdef(packed) == nnx.graphdef(expected)
    assert len(jax.tree.leaves(nnx.state(packed, PackedKernel))) > 0


def test_a_conversion_that_cannot_serve_is_an_error_naming_the_fix(tiny_dir, converted, tmp_path):
    with pytest.raises(ValueError, match=r"holds bfloat16 weights.*pass --dtype bfloat16"):
        _restore(converted, Preparation("float32"))
    packed = str(tmp_path / "packed")
    convert(tiny_dir, packed, Preparation("bfloat16", "native"))
    with pytest.raises(ValueError, match="convert with --packing none"):
        _restore(packed, Preparation("bfloat16"))
    data = [p for p in Path(packed, PREPARED_DIR).rglob("*") if p.is_file() and "/d/" in str(p)]
    for file in data:
        os.truncate(file, file.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"cannot be served: .*unreadable arrays"):
        _restore(packed, Preparation("bfloat16", "native"))


@pytest.mark.parametrize("packing", ["none", "native"])
def test_streamed_weights_are_those_the_host_prepares(tiny_dir, packing, request):
    if packing != "none":
        request.getfixturevalue("dense_kernels")  # packing needs a CPU with the native dense kernel
    preparation = Preparation("bfloat16", packing)
    _, expected = load_model(tiny_dir, jnp.bfloat16, on_host=True)
    preparation.apply(expected)
    _, got = load_prepared(tiny_dir, preparation, _ON_DEVICE)
    assert nnx.graphdef(got) == nnx.graphdef(expected)
    assert (len(jax.tree.leaves(nnx.state(got, PackedKernel))) > 0) == (packing != "none")
    expected_leaves = dict(nnx.to_flat_state(nnx.state(expected)))
    for path, var in nnx.to_flat_state(nnx.state(got)):
        value = var.get_value()
        assert value.sharding == _ON_DEVICE, path
        assert np.asarray(value).tobytes() == np.asarray(expected_leaves[path].get_value()).tobytes(), path
