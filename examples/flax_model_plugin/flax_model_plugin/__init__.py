# SPDX-License-Identifier: Apache-2.0
"""An out-of-tree Flax model for vllm-xla: `ScaledResidualLlamaForCausalLM`.

A Llama whose attention and MLP outputs are multiplied by `residual_multiplier` (a field of its
`config.json`) before they join the residual stream, as IBM's Granite models do.
"""

from __future__ import annotations

ARCHITECTURE = "ScaledResidualLlamaForCausalLM"


def register() -> None:
    """The `vllm.general_plugins` entry point. The classes are named, not imported: a process
    that only resolves the architecture (vLLM's front end) never imports JAX for them."""
    from plugin_shim import register_flax_model

    register_flax_model(
        ARCHITECTURE,
        "flax_model_plugin.model:ScaledResidualLlamaForCausalLM",
        config_class="flax_model_plugin.model:ScaledResidualConfig",
    )
