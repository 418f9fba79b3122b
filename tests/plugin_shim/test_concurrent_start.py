# SPDX-License-Identifier: Apache-2.0
"""Two processes starting at once on an empty cache directory: both materialize the embedded
model, build a program into the executable cache and store prepared weights; both succeed and
leave one whole, identical copy of each."""

import filecmp
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import load_model
from plugin_shim.model_dir import embedded_gguf_path
from tests.tiny_models import save_tiny_llama
from tpu_platform.programs import ExecutableCache, ProgramSpec
from tpu_platform.weights.cache import WeightsCache
from tpu_platform.weights.preparation import Preparation

_START_SCRIPT = """
import hashlib, json, os, sys, time
cache_dir, tiny, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
import jax, jax.numpy as jnp
from models import load_model
from plugin_shim.model_dir import materialize
from tpu_platform.programs import ExecutableCache, Programs, ProgramSpec, enable_persistent_cache
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.cache import WeightsCache
while time.time() < start_at:  # both processes go at the same moment, imports done
    time.sleep(0.005)
model_dir = materialize(cache_dir)
digest = hashlib.sha256()  # the directory as this process reads it (the other may still build)
for name in sorted(os.listdir(model_dir)):
    with open(os.path.join(model_dir, name), "rb") as f:
        digest.update(name.encode() + f.read())
enable_persistent_cache(cache_dir)
cache = ExecutableCache(os.path.join(cache_dir, "executables"), jax.devices()[0])
spec = ProgramSpec(key="sin", jitted=jax.jit(jnp.sin), args=(jax.ShapeDtypeStruct((5, 3), jnp.float32),))
Programs(strict=False, cache=cache).build(spec)
weights = WeightsCache.for_model(os.path.join(cache_dir, "weights"), tiny, Preparation("float32"))
weights.store(*load_model(tiny, jnp.float32, on_host=True))
paths = {"executable": cache.path(spec), "weights": weights.path}
print(json.dumps({"model_dir": model_dir, "model_digest": digest.hexdigest(), **paths}))
"""


def _start_two(cache_dir: pathlib.Path, tiny: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    start_at = str(time.time() + 25)  # after both have imported JAX and the packages
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _START_SCRIPT, str(cache_dir), tiny, start_at],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        assert time.time() > float(start_at), "a process finished before the common start"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _leftovers(directory: pathlib.Path) -> list[str]:
    """Staging directories and partial files a writer left behind."""
    return [
        p.name
        for p in directory.iterdir()
        if p.name.endswith(".tmp") or (p.name.startswith(".SmolLM2") and not p.name.endswith(".lock"))
    ]


@pytest.mark.slow
def test_two_processes_starting_at_once_share_whole_caches(tmp_path):
    cache_dir = tmp_path / "cache"
    tiny = save_tiny_llama(str(tmp_path / "tiny"), seed=5)
    first, second = _start_two(cache_dir, tiny)
    assert first == second  # the same directory, read whole and identical by both

    model_dir = pathlib.Path(first["model_dir"])
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    assert digest.hexdigest() == first["model_digest"]
    assert (model_dir / ".complete-v2").exists()
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == 30
    # its projections are all Q4_1, so the directory holds the GGUF itself (served from its
    # blocks), whole
    assert filecmp.cmp(model_dir / "model.gguf", embedded_gguf_path(), shallow=False)
    assert [p.name for p in (cache_dir / "models").iterdir() if p.is_dir()] == [model_dir.name]

    cache = ExecutableCache(str(cache_dir / "executables"), jax.devices()[0])
    loaded = cache.load(first["executable"])
    assert loaded is not None
    x = np.linspace(-3, 3, 15, dtype=np.float32).reshape(5, 3)
    np.testing.assert_allclose(np.asarray(loaded(x)), np.sin(x), rtol=1e-6)
    spec = ProgramSpec(key="sin", jitted=jax.jit(jnp.sin), args=(jax.ShapeDtypeStruct((5, 3), jnp.float32),))
    assert cache.path(spec) == first["executable"]

    weights = WeightsCache.for_model(str(cache_dir / "weights"), tiny, Preparation("float32"))
    assert weights.path == first["weights"]
    config, expected = load_model(tiny, jnp.float32, on_host=True)
    model = weights.load(config, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert model is not None
    got_leaves, want_leaves = jax.tree.leaves(model), jax.tree.leaves(expected)
    assert len(got_leaves) == len(want_leaves)
    for got, want in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    for directory in ("models", "executables", "weights"):
        assert _leftovers(cache_dir / directory) == []
