# SPDX-License-Identifier: Apache-2.0
"""Runs compile-only work in a subprocess that has the real TPU or GPU compiler on its path.

The toolchains (`make aot-toolchains`: libtpu, JAX's CUDA plugin) live in `.aot/<platform>`,
outside the venv, so this test process and every other one behave as on a machine without
them. A worker module here compiles what it is asked for with `tpu_platform.planner.targets` and prints
one JSON document as its last line of output; `run_worker` returns it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.xla_flags import without_test_flags

REPO = pathlib.Path(__file__).resolve().parents[2]
AOT_DIR = pathlib.Path(os.environ.get("VLLM_XLA_AOT_DIR", REPO / ".aot"))
_MARKERS = {"tpu": "libtpu", "cuda": "jax_plugins"}


def toolchain_path(platform: str) -> pathlib.Path:
    """`.aot/<platform>`, or an error naming the command that installs it."""
    path = AOT_DIR / platform
    if not (path / _MARKERS[platform]).is_dir():
        raise RuntimeError(f"no {platform} compile toolchain in {path}: run `make aot-toolchains`")
    return path


def worker_env(platform: str) -> dict[str, str]:
    """This process's environment with `platform`'s compiler on the path and JAX on the CPU."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(toolchain_path(platform)), str(REPO)]),
        JAX_PLATFORMS="cpu",  # the runtime stays on the CPU; only the compile targets are TPU/GPU
        TPU_ACCELERATOR_TYPE="v5litepod-4",  # quiets libtpu's start-up probes (no TPU here)
        TPU_WORKER_HOSTNAMES="localhost",
        # Compile-only: no TPU to guard, and workers (and parallel test runs) may overlap.
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    env.pop("VLLM_XLA_PLATFORM", None)
    env["XLA_FLAGS"] = without_test_flags(env.get("XLA_FLAGS", ""))  # the compilers as served
    return env


def run_worker(platform: str, module: str, *args: str, timeout: float = 1200) -> object:
    """Runs `python -m tests.aot.<module> *args` with `platform`'s compiler; its JSON answer."""
    proc = subprocess.run(
        [sys.executable, "-m", f"tests.aot.{module}", *args],
        cwd=REPO, env=worker_env(platform), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"tests.aot.{module} {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return json.loads(lines[-1])
