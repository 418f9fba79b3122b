# SPDX-License-Identifier: Apache-2.0
"""Every private JAX and Flax internal this package uses, each beside its public fallback.

A JAX or Flax release may rename or drop any of these. Each accessor then takes its public
fallback (slower, or less precise, never wrong) and logs one warning per internal and process
that names what is missing, so an upgrade is never silently degraded. The versions they are
known to work with are the ranges `pyproject.toml` pins.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(f"vllm_xla.{__name__}")

# Recorded by JAX when it writes an executable it has just compiled to its persistent cache
# (jax/_src/compilation_cache.py); no public API says whether a compile was served from a cache.
FRESH_COMPILE_EVENT = "/jax/compilation_cache/cache_misses"


@functools.cache
def warn_fallback(internal: str, fallback: str) -> None:
    """Logs, once per process, that `internal` is missing from this JAX/Flax and what is used instead."""
    logger.warning(
        "vllm-xla: this JAX %s / Flax has no %s (a private internal); using %s instead. "
        "Install a version in the range pyproject.toml pins to get it back.",
        jax.__version__,
        internal,
        fallback,
    )


def _xla_client():
    try:
        from jax._src.lib import xla_client
    except ImportError:
        return None
    return xla_client


def _jaxlib_extension():
    try:
        from jax._src.lib import _jax
    except ImportError:
        return None
    return _jax


# -- transfers ----------------------------------------------------------------------------------


def device_put(aval, sharding: jax.sharding.Sharding, value: np.ndarray, devices: Sequence) -> jax.Array:
    """`value` as an array of `aval` on `sharding`'s `devices`: JAX's C++ batched transfer (a tenth
    of `jax.device_put`'s host time), else `jax.device_put`."""
    put = getattr(_xla_client(), "batched_device_put", None)
    if put is None:
        warn_fallback("jax._src.lib.xla_client.batched_device_put", "jax.device_put")
        return jax.device_put(value, sharding)
    return put(aval, sharding, [value] * len(devices), devices, True)


# -- calling a compiled program on flat arguments -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlatProgram:
    """What calling a compiled program directly takes (see `tpu_platform.dispatch`)."""

    executable: Any  # the loaded XLA executable
    kept: tuple[int, ...]  # indices of the arguments the program uses
    handlers: Sequence  # wrap the output buffers as arrays
    avals: Sequence  # of the kept arguments
    shardings: Sequence  # of the kept arguments


_FLAT_CALL_FALLBACK = "JAX's own call of the compiled program"


def flat_program(compiled: jax.stages.Compiled) -> FlatProgram | None:
    """The parts of `compiled` a direct call needs, or None when it must go through JAX's call:
    the program has effects, host callbacks, mutable arguments or constants, or this JAX lacks
    one of the internals (warned once)."""
    mesh_executable = getattr(compiled, "_executable", None)
    params = getattr(compiled, "_params", None)
    call = getattr(mesh_executable, "unsafe_call", None)
    needed = (
        "xla_executable", "out_handler", "kept_var_idx", "ordered_effects", "has_unordered_effects",
        "has_host_callbacks", "mut",
    )  # fmt: skip
    if (
        call is None
        or not all(hasattr(call, name) for name in needed)
        or not all(hasattr(params, name) for name in ("const_args", "is_high"))
    ):
        warn_fallback("Compiled._executable.unsafe_call (a compiled program's parts)", _FLAT_CALL_FALLBACK)
        return None
    if not _runs_flat(call.xla_executable):
        return None
    if (
        call.ordered_effects
        or call.has_unordered_effects
        or call.has_host_callbacks
        or call.mut is not None
        or params.const_args
        or params.is_high
    ):
        return None
    kept = tuple(sorted(call.kept_var_idx))
    shardings = _kept_shardings(compiled, mesh_executable, kept)
    if shardings is None:
        return None
    handlers = call.out_handler.handlers
    return FlatProgram(call.xla_executable, kept, handlers, mesh_executable.in_avals, shardings)


def _runs_flat(executable) -> bool:
    """Whether the executable has `execute_sharded` and its results `consume_with_handlers`."""
    results = getattr(_jaxlib_extension(), "ExecuteResults", None)
    if not hasattr(executable, "execute_sharded") or not hasattr(results, "consume_with_handlers"):
        warn_fallback("LoadedExecutable.execute_sharded(...).consume_with_handlers", _FLAT_CALL_FALLBACK)
        return False
    return True


def _kept_shardings(compiled: jax.stages.Compiled, mesh_executable, kept: tuple[int, ...]) -> list | None:
    shardings = getattr(mesh_executable, "_in_shardings", None)
    if shardings is not None:
        return list(shardings)
    warn_fallback("MeshExecutable._in_shardings", "Compiled.input_shardings")
    flat, _ = jax.tree.flatten(compiled.input_shardings, is_leaf=lambda x: x is None)
    if max(kept, default=-1) >= len(flat):
        return None
    return [flat[i] for i in kept]


def execute(program: FlatProgram, args: Sequence[jax.Array]) -> list[jax.Array]:
    """Runs `program` on the kept arguments' arrays, in order; its outputs as arrays."""
    return program.executable.execute_sharded(args).consume_with_handlers(program.handlers)


def addressable_devices(sharding: jax.sharding.Sharding) -> list | None:
    """`sharding`'s devices on this host in the order its buffers go, or None when no public API
    gives that order (a sharding over several devices of this host, without the internal)."""
    devices = getattr(sharding, "_addressable_device_assignment", None)
    if devices is not None:
        return list(devices)
    warn_fallback("Sharding._addressable_device_assignment", "Sharding.addressable_devices")
    if len(sharding.addressable_devices) == 1:
        return list(sharding.addressable_devices)
    return None


# -- Flax -----------------------------------------------------------------------------------------


def variable_metadata_sorted(nodes: Sequence[Any]) -> list[Any]:
    """Flax graph definition nodes with every variable's metadata in key order (other nodes as
    they are): the nodes that are `flax.nnx.graphlib.VariableDef`s, else every dataclass node with
    a `metadata` mapping."""
    try:
        from flax.nnx.graphlib import VariableDef
    except ImportError:
        warn_fallback("flax.nnx.graphlib.VariableDef", "every graph node with a metadata mapping")
        VariableDef = object
    return [_metadata_sorted(node) if isinstance(node, VariableDef) else node for node in nodes]


def _metadata_sorted(node: Any) -> Any:
    metadata = getattr(node, "metadata", None)
    if not dataclasses.is_dataclass(node) or not isinstance(metadata, Mapping):
        return node
    return dataclasses.replace(node, metadata=type(metadata)(dict(sorted(metadata.items()))))
