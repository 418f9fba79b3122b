# SPDX-License-Identifier: Apache-2.0
"""The suite's XLA flags: LLVM's optimizations off for XLA:CPU, the served compilers elsewhere."""

import os
import subprocess
import sys

import pytest

from tests.aot.toolchains import worker_env
from tests.xla_flags import LLVM_OPTIMIZATIONS_OFF, with_host_devices, with_test_flags, without_test_flags


def test_this_process_compiles_with_the_suites_flag():
    assert LLVM_OPTIMIZATIONS_OFF in os.environ["XLA_FLAGS"].split()


def test_a_level_the_developer_set_is_kept():
    assert with_test_flags("--xla_backend_optimization_level=2") == "--xla_backend_optimization_level=2"
    assert with_test_flags("--xla_dump_to=/tmp/x") == f"--xla_dump_to=/tmp/x {LLVM_OPTIMIZATIONS_OFF}"


def test_simulated_devices_keep_the_suites_flag():
    flags = with_host_devices(4).split()
    assert LLVM_OPTIMIZATIONS_OFF in flags and "--xla_force_host_platform_device_count=4" in flags


def test_the_tpu_and_gpu_compile_workers_compile_as_served():
    assert without_test_flags(f"--a {LLVM_OPTIMIZATIONS_OFF} --b") == "--a --b"
    try:
        env = worker_env("cuda")
    except RuntimeError as missing:  # the fast tier runs without the toolchains
        pytest.skip(str(missing))
    assert LLVM_OPTIMIZATIONS_OFF not in env["XLA_FLAGS"].split()


_OPTIMIZED_HLO = """
import jax
import jax.numpy as jnp

def layer(x, w):
    return jax.nn.softmax(jnp.tanh(x @ w) * 3.0, axis=-1).sum(axis=0)

shapes = (jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))
print(jax.jit(layer).lower(*shapes).compile().as_text())
"""


def test_the_flag_leaves_xlas_optimized_program_as_served():
    """LLVM's level is all the flag changes: the optimized HLO (fusions, layouts) is XLA's
    default's, text for text."""
    texts = []
    for flags in ("", LLVM_OPTIMIZATIONS_OFF):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        command = [sys.executable, "-c", _OPTIMIZED_HLO]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        texts.append(done.stdout)
    assert "fusion" in texts[0] and texts[0] == texts[1]


_THREE_LEVELS = """
import jax
import jax.numpy as jnp
from tests.xla_flags import jit_kernel_run

def layer(x, w):
    return jax.nn.softmax(jnp.tanh(x @ w) * 3.0, axis=-1).sum(axis=0)

def suite(x, w):
    return layer(x, w)

def long(x, w):
    return layer(x, w)

def short(x, w):
    return layer(x, w)

shapes = (jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))
jax.jit(suite).lower(*shapes).compile()
jit_kernel_run(long, long_run=True).lower(*shapes).compile()
jit_kernel_run(short, long_run=False).lower(*shapes).compile()
"""


def test_long_running_kernel_programs_compile_at_xlas_default_level(tmp_path):
    """`jit_kernel_run` of a program whose run is the cost: its own options set XLA's default level,
    under the suite's flag; of another, the suite's level stays. XLA writes each
    program's options beside its dump, the non-default ones only."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"{LLVM_OPTIMIZATIONS_OFF} --xla_dump_to={tmp_path}",
        "JAX_PLATFORMS": "cpu",
    }
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _THREE_LEVELS], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    levels = {}
    for path in tmp_path.glob("module_*.jit_*.debug_options"):
        name = path.name.split(".jit_")[1].removesuffix(".debug_options")
        lines = [line for line in path.read_text().splitlines() if "xla_backend_optimization_level" in line]
        levels[name] = lines[0].split(":")[1].strip() if lines else "XLA's default"
    assert levels == {"suite": "0", "long": "XLA's default", "short": "0"}
