# SPDX-License-Identifier: Apache-2.0
"""Mosaic TPU backend: KV cache layout `[num_pages, 2K, S, Dp]`, its KV write and ragged paged attention."""

from pallas_kernels.tpu.kernel import ragged_paged_attention
from pallas_kernels.tpu.kv_write import write_kv, write_kv_reference
from pallas_kernels.tpu.layout import allocate_kv_cache

__all__ = ["allocate_kv_cache", "ragged_paged_attention", "write_kv", "write_kv_reference"]
