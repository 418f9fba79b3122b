# SPDX-License-Identifier: Apache-2.0
"""Paged KV cache and ragged paged attention for XLA devices (pure JAX, no vLLM)."""

from pallas_kernels.api import (
    SLOT_LIMIT,
    allocate_kv_cache,
    kv_cache_partition_spec,
    ragged_paged_attention,
    rope_write_kv,
    write_kv,
)
from pallas_kernels.backend import BACKENDS, resolve_backend

__all__ = [
    "BACKENDS",
    "SLOT_LIMIT",
    "allocate_kv_cache",
    "kv_cache_partition_spec",
    "ragged_paged_attention",
    "resolve_backend",
    "rope_write_kv",
    "write_kv",
]
