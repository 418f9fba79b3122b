# SPDX-License-Identifier: Apache-2.0
"""The prepared-weights cache (`load_format="npcache"`) against loading the checkpoint."""

import logging
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model
from pallas_kernels import cpu
from tests.tiny_models import save_tiny_llama
from tpu_platform.programs import structure_text
from tpu_platform.runner import Runner
from tpu_platform.runner_config import RunnerConfig
from tpu_platform.weights.cache import WeightsCache
from tpu_platform.weights.preparation import Preparation, int8_quantization
from tpu_platform.weights.prepared import load_prepared, metadata_for, save_prepared


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("weights_cache_llama")), seed=3)


def _assert_same_model(got, expected):
    got_def, got_state = nnx.split(got)
    expected_def, expected_state = nnx.split(expected)
    assert got_def == expected_def
    assert structure_text(got_def) == structure_text(expected_def)
    got_leaves, expected_leaves = nnx.to_flat_state(got_state), nnx.to_flat_state(expected_state)
    assert [path for path, _ in got_leaves] == [path for path, _ in expected_leaves]
    for (path, a), (_, b) in zip(got_leaves, expected_leaves, strict=True):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert a.tobytes() == np.ascontiguousarray(b).tobytes(), path  # bit for bit


def _preparation(dtype, packed):
    return Preparation(jnp.dtype(dtype).name, "native" if packed else "none")


def _prepared(path, preparation):
    config, model = load_model(path, jnp.dtype(preparation.dtype), on_host=True)
    preparation.apply(model)
    return config, model


_ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _load_logging_warnings(cache, config, caplog):
    """`cache.load(...)` with the weights cache's warnings captured in `caplog` (its logger does
    not propagate to the root one)."""
    log = logging.getLogger("vllm_xla.tpu_platform.weights.cache")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            return cache.load(config, _ON_DEVICE)
    finally:
        log.removeHandler(caplog.handler)


@pytest.mark.parametrize(
    ("dtype", "packed"), [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)]
)
def test_a_stored_model_comes_back_bit_for_bit(tiny_dir, tmp_path, request, dtype, packed):
    if packed:
        request.getfixturevalue("dense_kernels")
    preparation = _preparation(dtype, packed)
    cache = WeightsCache.for_model(str(tmp_path), tiny_dir, preparation)
    config, expected = _prepared(tiny_dir, preparation)
    assert cache.load(config, _ON_DEVICE) is None  # nothing stored yet
    cache.store(config, expected)
    month_ago = time.time() - 31 * 24 * 3600
    os.utime(cache.path, (month_ago, month_ago))
    got = cache.load(config, _ON_DEVICE)
    assert os.path.getmtime(cache.path) > month_ago + 24 * 3600  # marked used: kept by pruning
    _assert_same_model(got, expected)
    leaves = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(got))]
    assert all(isinstance(leaf, jax.Array) and leaf.sharding == _ON_DEVICE for leaf in leaves)
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".pkl", ".pickle", ".npcache")]


def test_a_changed_checkpoint_misses_and_its_stale_entry_goes(tiny_dir, tmp_path):
    float32, bfloat16 = _preparation(jnp.float32, False), _preparation(jnp.bfloat16, False)
    config, model = _prepared(tiny_dir, float32)
    first = WeightsCache.for_model(str(tmp_path), tiny_dir, float32)
    first.store(config, model)
    other_variant = WeightsCache.for_model(str(tmp_path), tiny_dir, bfloat16)
    other_variant.store(config, _prepared(tiny_dir, bfloat16)[1])
    (tmp_path / "0123-bfloat16-avx2-old.npcache").write_bytes(b"the former format")
    weights = os.path.join(tiny_dir, "model.safetensors")
    stat = os.stat(weights)
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        second = WeightsCache.for_model(str(tmp_path), tiny_dir, float32)
        assert second.path != first.path
        assert second.load(config, _ON_DEVICE) is None
        second.store(config, model)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    entries = sorted(os.listdir(tmp_path))
    assert entries == sorted(os.path.basename(c.path) for c in (second, other_variant))
    # An entry no start used for a month (here the other variant's) goes when one is stored.
    month_ago = time.time() - 31 * 24 * 3600
    os.utime(other_variant.path, (month_ago, month_ago))
    died = tmp_path / f"{os.path.basename(first.path)}.orbax-checkpoint-tmp-1"  # a store that died
    died.mkdir()
    os.utime(died, (month_ago, month_ago))
    shutil.rmtree(second.path)
    second.store(config, model)
    assert os.listdir(tmp_path) == [os.path.basename(second.path)]


def _damage(entry: str, damage: str, tiny_dir: str) -> None:
    if damage == "truncated":  # the largest array file loses its end
        largest = max((p for p in Path(entry).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        os.truncate(largest, largest.stat().st_size // 2)
    elif damage == "missing":
        shutil.rmtree(os.path.join(entry, "state"))
    elif damage == "foreign":  # another model's prepared weights under this name
        other = save_tiny_llama(os.path.join(os.path.dirname(entry), "other"), seed=4, hidden_size=32)
        config, model = _prepared(other, Preparation("float32"))
        shutil.rmtree(entry)
        save_prepared(entry, nnx.state(model), metadata_for(config, Preparation("float32"), nnx.state(model)))
        shutil.rmtree(other)
    else:  # not a checkpoint at all
        shutil.rmtree(entry)
        os.makedirs(os.path.join(entry, "metadata"))
        Path(entry, "metadata", "metadata").write_text("[1, 2]")


@pytest.mark.parametrize("damage", ["truncated", "missing", "foreign", "not ours"])
def test_an_unusable_entry_is_a_logged_miss_and_is_dropped(tiny_dir, tmp_path, caplog, damage):
    preparation = Preparation("float32")
    cache = WeightsCache.for_model(str(tmp_path), tiny_dir, preparation)
    config, model = _prepared(tiny_dir, preparation)
    cache.store(config, model)
    _damage(cache.path, damage, tiny_dir)
    assert _load_logging_warnings(cache, config, caplog) is None
    assert "dropping unusable weights cache entry" in caplog.text
    assert not os.path.exists(cache.path)
    cache.store(config, model)  # the next start stores it again
    _assert_same_model(cache.load(config, _ON_DEVICE), model)


def test_an_entry_others_may_write_is_not_read(tiny_dir, tmp_path, caplog):
    preparation = Preparation("float32")
    cache = WeightsCache.for_model(str(tmp_path), tiny_dir, preparation)
    config, model = _prepared(tiny_dir, preparation)
    cache.store(config, model)
    os.chmod(os.path.join(cache.path, "metadata"), 0o777)
    assert _load_logging_warnings(cache, config, caplog) is None
    assert "is writable by group or others" in caplog.text
    assert os.path.isdir(cache.path)  # not ours to judge: left in place
    os.chmod(tmp_path, 0o777)  # a cache directory others may write: nothing stored there either
    try:
        shutil.rmtree(cache.path)
        cache.store(config, model)
        assert not os.path.exists(cache.path)
    finally:
        os.chmod(tmp_path, 0o700)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_loads_the_same_weights_and_names_the_same_programs(tiny_dir, tmp_path, caplog, dtype):
    # The session's cache directory holds the native kernels (built once); the model lives in
    # this test's own directory, so its weights cache entries are this test's.
    cache_dir = os.environ["VLLM_XLA_CACHE_DIR"]
    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=3)

    def runner(load_format):
        config = RunnerConfig(
            model_path=model_dir, dtype=dtype, cache_dir=cache_dir, load_format=load_format,
            attention_backend="auto", page_size=16, max_model_len=64, max_num_seqs=2,
            max_num_batched_tokens=16,
        )  # fmt: skip
        loaded = Runner(config)
        loaded.load_model()
        loaded.initialize_kv_cache(8)
        return loaded

    log = logging.getLogger("vllm_xla.tpu_platform.runner")  # may not propagate: vLLM's handlers
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            reference = runner("auto")
            stored = runner("npcache")
            assert "from the checkpoint" in caplog.text and "from the weights cache" not in caplog.text
            cached = runner("npcache")
    finally:
        log.removeHandler(caplog.handler)
    assert "from the weights cache" in caplog.text
    for got in (stored, cached):
        assert got._graphdef == reference._graphdef
        assert got.step_program.context == reference.step_program.context  # the same cached executables
        assert str(got._state_def) == str(reference._state_def)
        for a, b in zip(got._state_leaves, reference._state_leaves, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if dtype == "bfloat16" and cpu.dense_isa(cpu.load(os.path.join(cache_dir, "native"))):
        assert "PackedKernel" in str(cached._state_def)  # the packed kernels came from the cache


def test_a_store_that_finds_its_entry_already_stored_keeps_it(tiny_dir, tmp_path, caplog):
    # Each store writes its own staging copy (Orbax's temporary name is fixed per destination, so
    # two processes storing one entry would share it) and renames it; the second finds the
    # first's entry there, keeps it and removes its own copy.
    preparation = _preparation("float32", packed=False)
    config, model = _prepared(tiny_dir, preparation)
    first, second = (WeightsCache.for_model(str(tmp_path), tiny_dir, preparation) for _ in range(2))
    first.store(config, model)
    stored = sorted(p.stat().st_ino for p in tmp_path.iterdir())
    log = logging.getLogger("vllm_xla.tpu_platform.weights.cache")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            second.store(config, model)
    finally:
        log.removeHandler(caplog.handler)
    assert sorted(p.stat().st_ino for p in tmp_path.iterdir()) == stored  # the first's, nothing else
    assert "could not cache" not in caplog.text
    _assert_same_model(second.load(config, _ON_DEVICE), model)


def test_a_model_whose_layers_reorder_their_inputs_is_not_stored(tiny_dir, tmp_path):
    """A GPTQ act-order checkpoint's layers hold input orders read from its g_idx, which a
    restore (the structure rebuilt from config.json) would not have: the entry is never written,
    so every start loads the checkpoint instead of writing and dropping an unusable entry."""
    from tests.models.gptq_checkpoints import write_gptq

    path, _ = write_gptq(tiny_dir, str(tmp_path / "act_order"), group_size=32, act_order=1)
    preparation = Preparation("float32", quantization="int4-g32")
    config, model = _prepared(path, preparation)
    assert model.model.layers[0].mlp.down_proj.input_order is not None
    cache = WeightsCache.for_model(str(tmp_path / "cache"), path, preparation)
    cache.store(config, model)
    assert not os.path.exists(cache.path)
    assert cache.load(config, _ON_DEVICE) is None


def test_the_float_layers_of_a_quantized_checkpoint_are_restored_float(tmp_path):
    """A block-fp8 checkpoint's ignored layers stay float when prepared (the runner's streamed
    load); the entry records them, so its restore, which rebuilds the structure from config.json,
    keeps them float too and the entry is used."""
    from tests.models.fp8_checkpoints import write_block_fp8

    source = save_tiny_llama(str(tmp_path / "source"), hidden_size=128, intermediate_size=256, seed=3)
    path = write_block_fp8(source, str(tmp_path / "fp8"), ignored=("model.layers.1.mlp.down_proj",))
    preparation = Preparation("float32", quantization=int8_quantization(path))
    config, model = load_prepared(path, preparation, _ON_DEVICE)
    assert model.model.layers[1].mlp.down_proj.kernel_scale is None
    assert model.model.layers[0].mlp.down_proj.kernel_scale is not None
    cache = WeightsCache.for_model(str(tmp_path / "cache"), path, preparation)
    cache.store(config, model)
    _assert_same_model(cache.load(config, _ON_DEVICE), model)
