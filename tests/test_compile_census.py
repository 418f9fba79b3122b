# SPDX-License-Identifier: Apache-2.0
"""`-p tests.compile_census`: a test file's compiles counted under its own name."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent

_TWO_PROGRAMS = """
import jax
import jax.numpy as jnp
import numpy as np


def test_two_programs():  # NumPy in and out: no other program is compiled
    assert np.asarray(jax.jit(jnp.sin)(np.zeros(3, np.float32))).sum() == 0.0
    assert np.asarray(jax.jit(jnp.cos)(np.zeros(5, np.float32))).sum() == 5.0
"""


def test_the_census_names_each_file_and_counts_its_compiles(tmp_path):
    (tmp_path / "test_compiles.py").write_text(_TWO_PROGRAMS)
    census = tmp_path / "census"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # one process
    env.update(PYTHONPATH=str(REPO), JAX_ENABLE_COMPILATION_CACHE="false")
    plugin = ["-p", "tests.compile_census", "--compile-census", str(census)]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, "test_compiles.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    events = json.loads((census / "main.json").read_text())["events"]
    assert list(events) == ["test_compiles.py"]
    count, seconds = events["test_compiles.py"]["/jax/core/compile/backend_compile_duration"]
    assert count == 2 and seconds > 0
