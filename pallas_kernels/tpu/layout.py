# SPDX-License-Identifier: Apache-2.0
"""KV cache layout of the Mosaic TPU backend (its KV write: kv_write.py).

Layout (a layer's; several layers stack along the page axis: api.py): `[num_pages, 2 * K, S, Dp]`,
with Dp = D rounded up to 128.
In page p, kv head h keeps its K rows in `[p, 2h]` and its V rows in `[p, 2h + 1]`: K and V
are interleaved head by head, and each is one `[S, Dp]` slab. Lanes D..Dp-1 stay zero.

Why this layout (TPU tiling; docs/kernels.md):
* One page of one layer is one contiguous `2K * S * Dp` chunk, so the kernel fetches K and V of
  every head with a single DMA per page: half the descriptors and semaphore waits of separate
  K and V arrays, and the block table is read once per page.
* The two minor dims of every slab are `(S, Dp)`: a whole number of `(8, 128)` f32 or `(16, 128)`
  bf16 tiles whatever K is, so the VMEM buffers carry no padding and the kernel picks a head's K
  or V with a plain index on an untiled axis. (Putting `2K` on the second-minor axis, as
  `[.., S, 2K, D]`, pads each tile 4x when K = 1 and needs strided sublane loads plus bf16
  bit tricks to separate K from V.)
* Dp = 128 fills the 128 lanes of a vreg and the MXU's contraction width; a VMEM buffer with a
  64-wide last dim would be padded to 128 lanes anyway. The price is 2x HBM for D = 64 models.

Axis letters: T tokens, K kv heads, S page size, D head dim, Dp padded head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.checks import check_positive

LANES = 128


def padded_head_dim(head_dim: int) -> int:
    """`head_dim` rounded up to a multiple of 128 lanes."""
    return -(-head_dim // LANES) * LANES


def sublane_tile(dtype: jnp.dtype) -> int:
    """Rows per (sublane, 128) TPU tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def allocate_kv_cache(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype
) -> jax.Array:
    """A zeroed cache `[num_pages, 2K, S, Dp]`: one layer's pages, or several layers' (api.py)."""
    check_positive(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return jnp.zeros((num_pages, 2 * num_kv_heads, page_size, padded_head_dim(head_dim)), dtype)
