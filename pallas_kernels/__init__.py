# SPDX-License-Identifier: Apache-2.0
"""Paged KV cache, ragged paged attention, paged latent attention (MLA) and Gated DeltaNet
(linear attention with per-request state) for XLA devices (pure JAX, no vLLM)."""

from pallas_kernels.api import (
    SLOT_LIMIT,
    allocate_kv_cache,
    kv_cache_partition_spec,
    ragged_paged_attention,
    rope_write_kv,
    write_kv,
)
from pallas_kernels.backend import BACKENDS, resolve_backend
from pallas_kernels.gated_delta import (
    allocate_state_pools,
    causal_conv1d,
    gated_delta_rule,
    state_bytes_per_slot,
    state_partition_specs,
)
from pallas_kernels.mla import (
    allocate_latent_cache,
    latent_cache_partition_spec,
    latent_page_bytes,
    mla_paged_attention,
    write_latent,
)

__all__ = [
    "BACKENDS",
    "SLOT_LIMIT",
    "allocate_kv_cache",
    "allocate_latent_cache",
    "allocate_state_pools",
    "causal_conv1d",
    "gated_delta_rule",
    "kv_cache_partition_spec",
    "latent_cache_partition_spec",
    "latent_page_bytes",
    "mla_paged_attention",
    "ragged_paged_attention",
    "resolve_backend",
    "rope_write_kv",
    "state_bytes_per_slot",
    "state_partition_specs",
    "write_kv",
    "write_latent",
]
