# SPDX-License-Identifier: Apache-2.0
"""Cache files another user could have written are never unpickled or loaded as code: the
executable cache, the weights cache and the native kernel build refuse them, say why, and the
executable and weights caches fall back to compiling or loading from the checkpoint."""

import logging
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import load_model
from pallas_kernels.cpu.build import NativeKernelError, build_library
from tests.tiny_models import save_tiny_llama
from tpu_platform.attention_backend import native_build_dir
from tpu_platform.prepared_weights import Preparation
from tpu_platform.private_files import UnsafeCacheError, check_private
from tpu_platform.programs import ExecutableCache, Programs, ProgramSpec, enable_persistent_cache
from tpu_platform.weights_cache import WeightsCache

_SCALE = 1.0 + random.random()  # programs no JAX cache has seen
_AS_ROOT = pytest.mark.skipif(os.getuid() != 0, reason="giving a file away needs root")


@pytest.fixture(autouse=True, scope="module")
def _jax_persistent_cache():
    enable_persistent_cache(os.environ["VLLM_XLA_CACHE_DIR"])


def _spec() -> ProgramSpec:
    return ProgramSpec(
        key="scaled-cos",
        jitted=jax.jit(lambda x, *, s: jnp.cos(x * s), static_argnames="s"),
        args=(jax.ShapeDtypeStruct((2, 3), jnp.float32),),
        static={"s": _SCALE},
    )


def _check_program(programs: Programs) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = programs.call("scaled-cos", _spec, x)
    np.testing.assert_allclose(np.asarray(got), np.cos(x * _SCALE), rtol=1e-6)


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def _stored_entry(directory: str) -> str:
    cache = ExecutableCache(directory, jax.devices()[0])
    Programs(strict=False, cache=cache).build(_spec())
    path = cache.path(_spec())
    assert os.path.exists(path)
    return path


def test_a_private_cache_is_created_private_and_used(tmp_path):
    directory = str(tmp_path / "executables")
    _stored_entry(directory)
    assert os.stat(directory).st_mode & 0o077 == 0
    programs = Programs(strict=False, cache=ExecutableCache(directory, jax.devices()[0]))
    _check_program(programs)
    assert programs.loaded == 1


def test_a_group_writable_entry_is_compiled_instead_and_replaced(tmp_path, caplog):
    directory = str(tmp_path / "executables")
    path = _stored_entry(directory)
    os.chmod(path, 0o664)
    with caplog.at_level(logging.WARNING):
        programs = Programs(strict=False, cache=ExecutableCache(directory, jax.devices()[0]))
        _check_program(programs)
    assert programs.loaded == 0
    assert f"refusing to load cached data from {path}" in _messages(caplog)
    assert "writable by group or others (mode 664)" in _messages(caplog)
    assert os.stat(path).st_mode & 0o022 == 0  # written again, by this user
    assert Programs(strict=False, cache=ExecutableCache(directory, jax.devices()[0])).build(_spec())


def test_a_world_writable_cache_directory_is_not_used(tmp_path, caplog):
    directory = str(tmp_path / "executables")
    path = _stored_entry(directory)
    os.chmod(directory, 0o777)
    with caplog.at_level(logging.WARNING):
        cache = ExecutableCache(directory, jax.devices()[0])
        programs = Programs(strict=False, cache=cache)
        _check_program(programs)
    assert programs.loaded == 0 and cache.unsafe
    assert f"not using the executable cache at {directory}" in _messages(caplog)
    assert f"chmod go-w {directory}" in _messages(caplog)
    os.unlink(path)
    Programs(strict=False, cache=cache).build(_spec())
    assert not os.path.exists(path)  # nothing is written there either


@_AS_ROOT
def test_an_entry_owned_by_another_user_is_refused(tmp_path, caplog):
    directory = str(tmp_path / "executables")
    path = _stored_entry(directory)
    os.chown(path, 12345, -1)
    with pytest.raises(UnsafeCacheError, match="owned by uid 12345"):
        check_private(path)
    with caplog.at_level(logging.WARNING):
        programs = Programs(strict=False, cache=ExecutableCache(directory, jax.devices()[0]))
        _check_program(programs)
    assert programs.loaded == 0 and "owned by uid 12345, not by the current user" in _messages(caplog)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("private_llama")), seed=4)


def test_the_native_build_never_uses_a_shared_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert native_build_dir(None) == "/home/someone/.cache/vllm-xla/native"  # the user's own
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(NativeKernelError, match=r"refusing to build or load the native kernels in .*shared"):
        build_library(shared)
    assert list(shared.iterdir()) == []  # nothing built or loaded there


def test_entries_written_under_a_permissive_umask_are_private_and_load(tiny_dir, tmp_path):
    """Entries are created readable and writable by the user alone whatever the umask (a
    group-writable one would be refused when read back)."""
    previous = os.umask(0o002)
    try:
        directory = str(tmp_path / "executables")
        path = _stored_entry(directory)
        cache = WeightsCache.for_model(str(tmp_path / "weights"), tiny_dir, Preparation("float32"))
        config, model = load_model(tiny_dir, jnp.float32, on_host=True)
        cache.store(config, model)
    finally:
        os.umask(previous)
    for entry in (path, cache.path):
        assert os.stat(entry).st_mode & 0o077 == 0
    assert Programs(strict=False, cache=ExecutableCache(directory, jax.devices()[0])).build(_spec())
    assert cache.load(config, jax.sharding.SingleDeviceSharding(jax.devices()[0])) is not None


def test_a_jax_cache_directory_others_can_write_is_not_used(tmp_path, caplog):
    (tmp_path / "jax").mkdir()
    os.chmod(tmp_path / "jax", 0o777)
    before = jax.config.jax_compilation_cache_dir
    with caplog.at_level(logging.WARNING):
        assert enable_persistent_cache(str(tmp_path)) is None
    assert jax.config.jax_compilation_cache_dir == before
    assert f"not using JAX's compilation cache at {tmp_path / 'jax'}" in _messages(caplog)
