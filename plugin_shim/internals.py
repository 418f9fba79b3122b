# SPDX-License-Identifier: Apache-2.0
"""Every private internal of JAX, prometheus_client and vLLM this package uses, each beside its public
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


class _AttentionProbe:
    """A view of a `VllmConfig` with its own attention config; every other attribute is the
    config's own (read by the hook, as in vLLM's own run of it)."""

    def __init__(self, config, attention_config):
        self._config = config
        self.attention_config = attention_config

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def model_default_attention_backend(config):
    """The attention backend vLLM's own config step for the model's architecture sets when the
    user names none (its `MODELS_CONFIG_MAP` hook, e.g. Gemma 4's TRITON_ATTN for heterogeneous
    head dims), run on a view of `config` whose attention config names none; None when the hook
    sets none. vLLM keeps the hooks in `vllm.model_executor.models.config.MODELS_CONFIG_MAP`,
    outside its public API; without it, None (any backend then counts as asked for)."""
    import copy
    import importlib

    hooks = getattr(importlib.import_module("vllm.model_executor.models.config"), "MODELS_CONFIG_MAP", None)
    if not isinstance(hooks, dict):
        warn_fallback(
            "vllm.model_executor.models.config.MODELS_CONFIG_MAP", "'every attention backend is the user's'"
        )
        return None
    hook = hooks.get(getattr(config.model_config, "architecture", None))
    if hook is None or config.attention_config is None:
        return None
    attention = copy.deepcopy(config.attention_config)
    attention.backend = None
    probe = _AttentionProbe(config, attention)
    hook.verify_and_update_config(probe)
    return probe.attention_config.backend
