# SPDX-License-Identifier: Apache-2.0
"""Mosaic TPU backend: KV cache layout `[num_pages, 2K, S, Dp]` and ragged paged attention."""

from pallas_kernels.tpu.kernel import ragged_paged_attention
from pallas_kernels.tpu.layout import allocate_kv_cache, write_kv

__all__ = ["allocate_kv_cache", "ragged_paged_attention", "write_kv"]
