# SPDX-License-Identifier: Apache-2.0
"""Argument checks shared by the Pallas kernel wrappers (gpu/kernel.py, tpu/kernel.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import FLOAT8_DTYPES


def compute_dtype(cache_dtype: jnp.dtype) -> jnp.dtype:
    """The matmul operand dtype of a Pallas kernel reading a `cache_dtype` cache: the cache's own,
    except float8, whose keys and values widen to bfloat16 as they are read (q stays bfloat16:
    quantizing queries to float8 would cost accuracy the cache does not need to lose)."""
    cache_dtype = jnp.dtype(cache_dtype)
    return jnp.dtype(jnp.bfloat16) if cache_dtype in FLOAT8_DTYPES else cache_dtype


def check_lanes(kv_cache: jax.Array, head_dim: int, padded_head_dim: int) -> None:
    """kv_cache's last dim is the backend's padded head dim."""
    if kv_cache.shape[-1] != padded_head_dim:
        raise ValueError(f"kv_cache {kv_cache.shape} last dim must be {padded_head_dim} for D={head_dim}")


def check_metadata(
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    """Block table `[R, P]`, kv_lens `[R]`, cu_q_lens `[R + 1]` (all int32), num_seqs `[]` or `[1]`,
    and positive sliding_window / soft_cap when given."""
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices {page_indices.shape} must be [R, P]")
    num_slots = page_indices.shape[0]
    if kv_lens.shape != (num_slots,) or cu_q_lens.shape != (num_slots + 1,) or num_seqs.size != 1:
        raise ValueError(
            f"want kv_lens [R], cu_q_lens [R + 1], num_seqs [] or [1] with R = {num_slots}; got "
            f"{kv_lens.shape}, {cu_q_lens.shape}, {num_seqs.shape}"
        )
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")


def check_positive_option(name: str, value: int | None) -> None:
    """A ValueError naming option `name` when it is given and not positive."""
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_positive(**dims: int) -> None:
    """A ValueError naming the first of `dims` that is not positive."""
    for name, value in dims.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
