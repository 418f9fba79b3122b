# SPDX-License-Identifier: Apache-2.0
"""Proof that vLLM really runs on our platform (vLLM silently falls back when a plugin fails)."""

from __future__ import annotations


def assert_active() -> None:
    """Raises unless vLLM's current platform is the vllm-xla platform."""
    from vllm.platforms import current_platform

    from plugin_shim.platform import XlaPlatform

    if not isinstance(current_platform, XlaPlatform):
        raise RuntimeError(
            f"vLLM is running on {type(current_platform).__name__}, not vllm-xla: set VLLM_XLA_PLATFORM "
            "(tpu, gpu or cpu), check that `vllm-xla` is installed, "
            "and look for 'Failed to load plugin' above"
        )
