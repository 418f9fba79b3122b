# SPDX-License-Identifier: Apache-2.0
"""Pallas GPU (Triton) backend: KV cache layout `[2, K, num_pages, S, Dp]` and ragged paged attention."""

from pallas_kernels.gpu.kernel import ragged_paged_attention
from pallas_kernels.gpu.layout import allocate_kv_cache, write_kv

__all__ = ["allocate_kv_cache", "ragged_paged_attention", "write_kv"]
