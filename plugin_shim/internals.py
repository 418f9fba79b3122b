# SPDX-License-Identifier: Apache-2.0
"""Every private internal of JAX and prometheus_client this package uses, each beside its public
fallback; a missing one is warned about once per process (see `tpu_platform.internals`)."""

from __future__ import annotations

import sys

from tpu_platform.internals import warn_fallback


def jax_backends_initialized() -> bool:
    """Whether this process has started a JAX backend, found without importing JAX: JAX's
    `xla_bridge.backends_are_initialized`, else whether JAX is imported at all (it may run)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:
        return False  # JAX's backends live in that module: not imported, not started
    initialized = getattr(bridge, "backends_are_initialized", None)
    if initialized is None:
        warn_fallback("jax._src.xla_bridge.backends_are_initialized", "'JAX is imported, so it may run here'")
        return True
    return bool(initialized())


def registered_collector(registry, name: str):
    """The collector `registry` holds under metric `name` (a second engine in the same process
    registers the same gauges), or None: prometheus_client's `_names_to_collectors`, else None
    (the caller then keeps its own collectors; see `plugin_shim.stat_logger._gauge`)."""
    names = getattr(registry, "_names_to_collectors", None)
    if names is None:
        warn_fallback("prometheus_client CollectorRegistry._names_to_collectors", "the gauges made here")
        return None
    return names.get(name)
