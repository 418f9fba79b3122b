# SPDX-License-Identifier: Apache-2.0
"""Programs: built once, reloaded from the executable cache by a new process's runner, keyed by
everything that shapes them, and refused after warm-up in strict mode."""

import ast
import functools
import os
import pathlib
import random
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_platform.disk_cache import source_fingerprint
from tpu_platform.programs import (
    ExecutableCache,
    Programs,
    ProgramSpec,
    enable_persistent_cache,
)


def _scaled_softmax(x, w, *, temperature):
    return jax.nn.softmax((x @ w) / temperature, axis=-1)


def _numpy_scaled_softmax(x, w, temperature):
    z = (x @ w) / temperature
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


_JITTED = jax.jit(_scaled_softmax, static_argnames=("temperature",))
# A temperature of this session only: JAX's caches (in memory or on disk, from an earlier session)
# never know the programs, so they are compiled here and written (the cache under test only keeps
# executables XLA compiled itself).
_T = 1.0 + random.random()


@pytest.fixture(autouse=True, scope="module")
def _jax_persistent_cache():
    enable_persistent_cache(os.environ["VLLM_XLA_CACHE_DIR"])


def _spec(rows: int, temperature: float = _T, context: str = "model-a") -> ProgramSpec:
    x = jax.ShapeDtypeStruct((rows, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 5), jnp.float32)
    return ProgramSpec(
        key=("softmax", rows, temperature),
        jitted=_JITTED,
        args=(x, w),
        static={"temperature": temperature},
        context=context,
    )


def _inputs(rows: int):
    rng = np.random.default_rng(rows)
    return rng.standard_normal((rows, 8), np.float32), rng.standard_normal((8, 5), np.float32)


@pytest.fixture
def cache_dir(tmp_path):
    return str(tmp_path / "executables")


def test_program_is_loaded_from_disk_by_a_new_instance_and_computes_the_same(cache_dir):
    device = jax.devices()[0]
    first = Programs(strict=False, cache=ExecutableCache(cache_dir, device))
    assert first.build_all([_spec(4), _spec(16)], workers=2) == 2
    x, w = _inputs(16)
    spec = _spec(16)
    stored = first.call(spec.key, lambda: spec, x, w)

    second = Programs(strict=True, cache=ExecutableCache(cache_dir, device))
    assert second.build(_spec(16)) is True
    assert (second.count, second.loaded) == (1, 1)
    loaded = second.call(spec.key, lambda: pytest.fail("should be ready"), x, w)
    np.testing.assert_allclose(np.asarray(loaded), _numpy_scaled_softmax(x, w, _T), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(stored))


def test_entries_unused_for_30_days_go_when_a_cache_opens_and_loading_one_keeps_it(cache_dir):
    device = jax.devices()[0]
    cache = ExecutableCache(cache_dir, device)
    Programs(strict=False, cache=cache).build_all([_spec(4), _spec(16)], workers=1)
    used, unused = cache.path(_spec(4)), cache.path(_spec(16))
    other = os.path.join(cache_dir, "source-digests.json")  # not an executable: never removed
    month_ago = time.time() - 31 * 24 * 3600
    for path in (used, unused, other):
        os.utime(path, (month_ago, month_ago))
    assert cache.load(used) is not None  # a start that uses an entry marks it used
    assert os.path.getmtime(used) > month_ago + 24 * 3600
    ExecutableCache(cache_dir, device)
    assert os.path.exists(used) and os.path.exists(other)
    assert not os.path.exists(unused)


@pytest.mark.parametrize(
    "changed",
    [_spec(4, temperature=_T + 1), _spec(4, context="model-b"), _spec(8)],
    ids=["static-argument", "context", "shape"],
)
def test_anything_that_shapes_a_program_names_a_different_entry(cache_dir, changed):
    cache = ExecutableCache(cache_dir, jax.devices()[0])
    assert cache.path(changed) != cache.path(_spec(4))
    assert cache.path(_spec(4)) == ExecutableCache(cache_dir, jax.devices()[0]).path(_spec(4))


def test_unreadable_entry_is_dropped_and_rebuilt(cache_dir):
    device = jax.devices()[0]
    spec = _spec(4, temperature=_T + 2)  # not compiled by another test of this session
    cache = ExecutableCache(cache_dir, device)
    pathlib.Path(cache.path(spec)).write_bytes(b"truncated")
    programs = Programs(strict=False, cache=cache)
    programs.build(spec)
    assert programs.loaded == 0
    x, w = _inputs(4)
    out = programs.call(spec.key, lambda: spec, x, w)
    np.testing.assert_allclose(np.asarray(out), _numpy_scaled_softmax(x, w, _T + 2), rtol=1e-5, atol=1e-6)
    assert os.path.getsize(cache.path(spec)) > 1000  # replaced by a real executable


def test_after_seal_a_missing_program_is_an_error_in_strict_mode_and_counted_otherwise():
    x, w = _inputs(4)
    strict = Programs(strict=True, cache=None)
    strict.build(_spec(4))
    strict.seal()
    strict.call(_spec(4).key, lambda: _spec(4), x, w)
    x8, _ = _inputs(8)
    with pytest.raises(RuntimeError, match=r"after warm-up for \('softmax', 8, .*STRICT_COMPILE"):
        strict.call(_spec(8).key, lambda: _spec(8), x8, w)

    lenient = Programs(strict=False, cache=None)
    lenient.seal()
    out = lenient.call(_spec(8).key, lambda: _spec(8), x8, w)
    np.testing.assert_allclose(np.asarray(out), _numpy_scaled_softmax(x8, w, _T), rtol=1e-5, atol=1e-6)
    assert (lenient.count, lenient.compiles_after_warmup) == (1, 1)


_BUILD_SCRIPT = """
import os, sys
import jax, jax.numpy as jnp
from tpu_platform.programs import ExecutableCache, Programs, ProgramSpec, enable_persistent_cache
root, name, call_first = sys.argv[1:]
enable_persistent_cache(os.path.join(root, "jax"))
spec = ProgramSpec(key="tanh", jitted=jax.jit(jnp.tanh), args=(jax.ShapeDtypeStruct((3, 7), jnp.float32),))
x = jnp.linspace(-2, 2, 21, dtype=jnp.float32).reshape(3, 7)
if call_first == "yes":  # JAX's in-memory cache then holds the program
    jax.jit(jnp.tanh)(x).block_until_ready()
cache = ExecutableCache(os.path.join(root, name), jax.devices()[0])
programs = Programs(strict=False, cache=cache)
programs.build(spec)
correct = bool(jnp.allclose(programs.call("tanh", None, x), jnp.tanh(x)))
print(os.path.exists(cache.path(spec)), programs.loaded, correct)
"""


def _build_in_new_process(root: pathlib.Path, executables: str, call_first: str = "no") -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    run = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, str(root), executables, call_first],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


@pytest.mark.slow  # five fresh processes, each importing JAX and compiling
def test_entries_are_written_even_when_jax_caches_hold_the_program(tmp_path):
    """XLA:CPU cannot re-serialize what JAX loaded from its persistent cache, so a program bound for
    an empty executable cache is compiled afresh even when JAX's caches (on disk, from an earlier
    process; in memory, from a plain call) hold it, and the entry written loads and computes right
    in a later process. All processes share one JAX cache; "[stored, loaded, correct]" each."""
    assert _build_in_new_process(tmp_path, "a") == ["True", "0", "True"]
    assert _build_in_new_process(tmp_path, "b") == ["True", "0", "True"]
    assert _build_in_new_process(tmp_path, "b") == ["True", "1", "True"]
    assert _build_in_new_process(tmp_path, "c", call_first="yes") == ["True", "0", "True"]
    assert _build_in_new_process(tmp_path, "c") == ["True", "1", "True"]


def _package(root: pathlib.Path, body: str) -> pathlib.Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(body)
    return root


def test_source_fingerprint_ignores_comments_and_docstrings_but_not_code(tmp_path):
    fingerprint = functools.partial(source_fingerprint, packages=("pkg",))
    base = fingerprint(_package(tmp_path / "a", 'def f(x):\n    """Doc."""\n    return x + 1\n'))
    commented = fingerprint(
        _package(tmp_path / "b", '# note\ndef f(x):\n    """Other words."""\n    return x + 1  # why\n')
    )
    changed = fingerprint(_package(tmp_path / "c", 'def f(x):\n    """Doc."""\n    return x + 2\n'))
    assert base == commented
    assert base != changed


def test_source_fingerprint_memo_parses_only_changed_modules(tmp_path, monkeypatch):
    """With a memo directory, a second start reuses the syntax-tree digests of unchanged modules
    and still sees a changed one; a torn memo file is ignored."""
    parsed = []
    real_parse = ast.parse
    monkeypatch.setattr(
        ast, "parse", lambda source, *a, **k: parsed.append(source) or real_parse(source, *a, **k)
    )
    root, memo = _package(tmp_path / "src", "def f(x):\n    return x + 1\n"), tmp_path / "memo"
    memo.mkdir()
    (root / "pkg" / "other.py").write_text("Y = 2\n")

    def fingerprint() -> str:
        return source_fingerprint.__wrapped__(root, ("pkg",), str(memo))

    first = fingerprint()
    assert len(parsed) == 2 and (memo / "source-digests.json").exists()
    parsed.clear()
    assert fingerprint() == first and parsed == []
    assert fingerprint() == source_fingerprint.__wrapped__(root, ("pkg",))  # the memo changes nothing
    parsed.clear()
    (root / "pkg" / "mod.py").write_text("def f(x):\n    return x + 2\n")
    changed = fingerprint()
    assert changed != first and parsed == [b"def f(x):\n    return x + 2\n"]
    (memo / "source-digests.json").write_text('{"torn')
    assert fingerprint() == changed


def test_a_modules_syntax_tree_is_built_with_the_collector_off(tmp_path, monkeypatch):
    """Python 3.11's syntax-tree constructor keeps its depth per interpreter: a collection inside
    the parse can run finalizers that switch threads, and another thread's parse then fails this
    one ("AST constructor recursion depth mismatch", seen in a full run). Without the collector
    nothing switches threads until the tree is built."""
    import gc

    collector_on = []
    real_parse = ast.parse
    monkeypatch.setattr(
        ast,
        "parse",
        lambda source, *a, **k: collector_on.append(gc.isenabled()) or real_parse(source, *a, **k),
    )
    assert gc.isenabled()
    source_fingerprint.__wrapped__(_package(tmp_path, "def f(x):\n    return x + 1\n"), ("pkg",))
    assert collector_on == [False] and gc.isenabled()


def test_the_collector_is_paused_inside_and_left_as_it_was():
    import gc

    from tpu_platform.collector import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("an error inside")
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()
