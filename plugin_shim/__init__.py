# SPDX-License-Identifier: Apache-2.0
"""vLLM platform plugin: the only package that imports vllm or torch."""

from __future__ import annotations

PLATFORM_CLASS = "plugin_shim.platform.XlaPlatform"


def register() -> str | None:
    """The `vllm.platform_plugins` entry point.

    Active when `VLLM_XLA_PLATFORM` names a device kind, or when a TPU is visible to JAX;
    otherwise None, so a machine whose vLLM uses another platform (CUDA, CPU) is never taken
    over by surprise. A vLLM outside the tested range is logged (`plugin_shim.versions`); one
    without the interfaces the plugin is built on leaves it inactive.
    """
    import vllm
    from vllm.logger import init_logger

    from plugin_shim.devices import detect_tpu
    from plugin_shim.versions import vllm_usable
    from tpu_platform.envs import read_env

    kind = read_env().platform
    if kind is None and detect_tpu():
        kind = "tpu"
    if kind is None:
        return None
    if not vllm_usable(vllm.__version__, init_logger("vllm.xla")):
        return None
    init_logger("vllm.xla").info("vllm-xla platform plugin active: the model runs on JAX %s devices", kind)
    return PLATFORM_CLASS


def register_flax_model(
    architecture: str, model_class: type | str, *, config_class: type | str | None = None
) -> None:
    """Serves `architecture` with an out-of-tree Flax model (`plugin_shim.flax_models`; the
    contract: docs/models.md). Imported on call: this package's import stays free of torch."""
    from models.config import ModelConfig
    from plugin_shim.flax_models import register_flax_model as register

    register(architecture, model_class, config_class=config_class or ModelConfig)
