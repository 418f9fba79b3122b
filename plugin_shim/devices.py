# SPDX-License-Identifier: Apache-2.0
"""Device-kind detection that does not initialise JAX in the calling process.

Opening a TPU in the front-end process would lock it away from the engine process, so the
probe runs JAX in a short-lived subprocess, and only when an accelerator runtime is installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

_PROBE = "import jax; print(jax.devices()[0].platform)"


def _probe_platform() -> str | None:
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def _installed(*modules: str) -> bool:
    return any(importlib.util.find_spec(m) is not None for m in modules)


def detect_tpu() -> bool:
    """True when libtpu is installed and JAX's default device is a TPU."""
    return _installed("libtpu") and _probe_platform() == "tpu"


def detect_device_kind() -> str:
    """'tpu', 'gpu' or 'cpu': what JAX would run on here."""
    if _installed("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins"):
        platform = _probe_platform()
        if platform == "tpu":
            return "tpu"
        if platform in ("gpu", "cuda", "rocm"):
            return "gpu"
    return "cpu"
