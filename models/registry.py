# SPDX-License-Identifier: Apache-2.0
"""Building a model of a config's architecture, and naming a registered architecture's code.

The table of architectures (built in and registered) is `models.architectures`, a leaf module;
its lookups are re-exported here.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import pathlib

import jax.numpy as jnp
from flax import nnx

from models.architectures import (
    SUPPORTED_ARCHITECTURES,
    config_class,
    imported,
    model_class,
    register_architecture,
    registered,
    serving_refusal,
    supported_architectures,
    unsupported_message,
)
from models.config import ModelConfig

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "architecture_fingerprint",
    "build",
    "config_class",
    "model_class",
    "register_architecture",
    "serving_refusal",
    "supported_architectures",
    "unsupported_message",
]


def architecture_fingerprint(architecture: str) -> str:
    """A hash of a registered architecture's code (every module of the packages its classes
    come from), for naming the programs compiled from it; "" for a built-in one, whose code
    the runner's own fingerprint covers."""
    entry = registered(architecture)
    if entry is None:
        return ""
    digest = hashlib.sha256()
    for cls in (imported(entry.model_class), imported(entry.config_class)):
        for path in _package_sources(cls):
            digest.update(str(path).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _package_sources(cls: type) -> list[pathlib.Path]:
    """The `.py` files of the top-level package that defines `cls` (its one file for a module)."""
    if cls.__module__.split(".")[0] == __name__.split(".")[0]:
        return []  # ours: covered by the runner's own fingerprint
    top = importlib.import_module(cls.__module__.split(".")[0])
    origin = pathlib.Path(inspect.getfile(top))
    if origin.name != "__init__.py":
        return [origin]
    return sorted(origin.parent.rglob("*.py"))


def build(config: ModelConfig, dtype: jnp.dtype = jnp.float32) -> nnx.Module:
    """An uninitialised (zero) model of `config`'s architecture in `dtype`."""
    return model_class(config.architecture)(config, dtype=jnp.dtype(dtype))
