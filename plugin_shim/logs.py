# SPDX-License-Identifier: Apache-2.0
"""The runtime's log lines (logger `vllm_xla.*`, vLLM-free) printed like vLLM's own."""

from __future__ import annotations

import logging


def share_vllm_logging() -> logging.Logger:
    """Gives the `vllm_xla` logger vLLM's handlers and level (idempotent); returns it."""
    from vllm.logger import init_logger

    vllm_logger = init_logger("vllm")
    ours = logging.getLogger("vllm_xla")
    if not ours.handlers and vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level or logging.INFO)
        ours.propagate = False
    return ours
