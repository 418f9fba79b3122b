# SPDX-License-Identifier: Apache-2.0
"""Cache files another user could have written are never unpickled or loaded as code: the
executable cache, the weights cache and the native kernel build refuse them, or a directory above
them that another user could replace, or a file swapped in after its check; they say why, and the
executable and weights caches fall back to compiling or loading from the checkpoint."""

import logging
import os
import pickle
import random
import re
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import load_model
from pallas_kernels import private_files
from pallas_kernels.cpu import build
from pallas_kernels.cpu.build import NativeKernelError, build_library
from tests.tiny_models import save_tiny_llama
from tpu_platform.attention_backend import native_build_dir
from tpu_platform.private_files import UnsafeCacheError, check_private
from tpu_platform.programs import ExecutableCache, Programs, ProgramSpec, enable_persistent_cache
from tpu_platform.weights.cache import WeightsCache
from tpu_platform.weights.preparation import Preparation

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


def _shared_ancestor(tmp_path, mode: int):
    """`tmp_path/shared` with `mode`, a directory above the caches."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    return shared


def test_a_group_writable_ancestor_is_refused_everywhere(tmp_path, tiny_dir, caplog):
    """A directory others may write, above a private cache, lets them swap the cache after its
    check: the executable cache, JAX's cache, the weights cache and the native build refuse it."""
    shared = _shared_ancestor(tmp_path, 0o775)
    cache_dir = shared / "user" / "cache"
    refusal = f"its ancestor {shared} is writable by group or others without the sticky bit (mode 775)"
    with caplog.at_level(logging.WARNING):
        cache = ExecutableCache(str(cache_dir / "executables"), jax.devices()[0])
        programs = Programs(strict=False, cache=cache)
        _check_program(programs)
        assert enable_persistent_cache(str(cache_dir)) is None
        weights = WeightsCache.for_model(str(cache_dir / "weights"), tiny_dir, Preparation("float32"))
        config, model = load_model(tiny_dir, jnp.float32, on_host=True)
        weights.store(config, model)
    assert programs.loaded == 0 and refusal in cache.unsafe
    assert not os.listdir(cache_dir / "executables")  # nothing written there either
    assert f"not using JAX's compilation cache at {cache_dir / 'jax'}: {refusal}" in _messages(caplog)
    assert f"not caching the prepared weights in {cache_dir / 'weights'}: {refusal}" in _messages(caplog)
    with pytest.raises(
        NativeKernelError, match=f"refusing to build or load the native kernels in .*{re.escape(refusal)}"
    ):
        build_library(cache_dir / "native")
    os.chmod(shared, 0o755)  # the same caches, once nobody else can write above them, are used
    _stored_entry(str(cache_dir / "executables"))
    assert Programs(
        strict=False, cache=ExecutableCache(str(cache_dir / "executables"), jax.devices()[0])
    ).build(_spec())


def test_a_sticky_world_writable_ancestor_like_tmp_is_trusted(tmp_path):
    """In a sticky directory only an entry's owner may rename or remove it, and the entries below
    are checked themselves: a private cache under one (say `/tmp/me/cache`) is used."""
    directory = str(_shared_ancestor(tmp_path, 0o1777) / "user" / "executables")
    _stored_entry(directory)
    programs = Programs(strict=False, cache=ExecutableCache(directory, jax.devices()[0]))
    _check_program(programs)
    assert programs.loaded == 1


class _Planted:
    """A pickle that, when loaded, leaves a marker file: loading it would run another user's code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("swapped_mode", [0o666, 0o600])
def test_an_entry_swapped_after_its_check_is_not_unpickled(tmp_path, monkeypatch, caplog, swapped_mode):
    """The entry is unpickled from the descriptor that was judged (`fstat`), so a file renamed
    over it between the path check and the open is refused: one others may write by its mode,
    a private-looking one because it is not the file the check saw."""
    directory = str(tmp_path / "executables")
    path = _stored_entry(directory)
    marker = tmp_path / "planted-code-ran"
    checked = private_files.check_private

    def check_then_swap(candidate):
        status = checked(candidate)
        planted = f"{candidate}.planted"
        with open(planted, "wb") as f:
            pickle.dump(_Planted(str(marker)), f)
        os.chmod(planted, swapped_mode)
        os.replace(planted, candidate)
        return status

    monkeypatch.setattr(private_files, "check_private", check_then_swap)
    with caplog.at_level(logging.WARNING):
        programs = Programs(strict=False, cache=ExecutableCache(directory, jax.devices()[0]))
        _check_program(programs)
    assert programs.loaded == 0 and not marker.exists()
    reason = "writable by group or others (mode 666)" if swapped_mode == 0o666 else "was replaced between"
    assert f"refusing to load cached data from {path}: " in _messages(caplog) and reason in _messages(caplog)


def _tiny_compiler(tmp_path) -> str:
    """A compiler that links a one-function library to its `-o` file whatever it is asked to
    build, with the real C++ compiler, which creates it as every linker does: under the umask
    (group-writable under 002)."""
    script = tmp_path / "tiny-c++"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo tiny-c++ 1; exit 0; fi\n'
        'while [ $# -gt 1 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
        f"echo 'extern \"C\" int VllmXlaDenseIsas() {{ return 42; }}' | "
        f'{build.find_compiler()} -shared -fPIC -x c++ - -o "$out"\n'
    )
    script.chmod(0o755)
    return str(script)


def test_a_library_built_under_umask_002_is_private_and_loads(tmp_path, monkeypatch):
    """Built under a group-writable umask, the library and the directories made for it are
    private, so the next start uses it instead of refusing it (and falling back to the slower
    backend); it is loaded through the descriptor that was judged."""
    monkeypatch.setenv("CXX", _tiny_compiler(tmp_path))
    build_dir = tmp_path / "made" / "for" / "native"
    previous = os.umask(0o002)
    try:
        library = build_library(build_dir)
        assert build_library(build_dir) == library  # the next start: judged private, reused
    finally:
        os.umask(previous)
    for path in (library, build_dir, build_dir.parent, build_dir.parent.parent):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    assert build._shared_object(build._Library(library.name, library)).VllmXlaDenseIsas() == 42


def test_a_library_swapped_after_its_check_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", _tiny_compiler(tmp_path))
    library = build_library(tmp_path / "native")
    checked = private_files.check_private

    def check_then_swap(candidate):
        status = checked(candidate)
        planted = tmp_path / "planted.so"
        planted.write_bytes(library.read_bytes())
        planted.chmod(0o777)
        os.replace(planted, candidate)
        return status

    monkeypatch.setattr(private_files, "check_private", check_then_swap)
    with pytest.raises(
        NativeKernelError, match=r"refusing to load the native kernels: .*writable by group or others"
    ):
        build._shared_object(build._Library("swapped-" + library.name, library))
