# SPDX-License-Identifier: Apache-2.0
"""Per-row keys and the random draw.

Each row gets a threefry key from (key data, salt, tokens generated so far); a seeded row's key
therefore depends only on its seed and progress, never on the batch. The per-token noise is
counter-based: two 32-bit integer finalizers (murmur3 `fmix32`, then `lowbias32`) of (row key, token
id), a few integer ops per token instead of a threefry block, like vLLM's CPU sampler (per-token
SplitMix64 streams). The draw is vLLM's: argmax(probs / Exponential(1)), one `log` per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_platform.sampling.ops import first_argmax


def row_keys(key_data: jax.Array, salt: jax.Array, num_generated: jax.Array) -> jax.Array:
    """uint32[R, 2]: the threefry key fold_in(fold_in(key_data[r], salt[r]), num_generated[r])."""
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(keys, salt)
    keys = jax.vmap(jax.random.fold_in)(keys, num_generated)
    return jax.random.key_data(keys)


def _mix(x: jax.Array, multipliers: tuple[int, int], shifts: tuple[int, int, int]) -> jax.Array:
    x = x ^ (x >> shifts[0])
    x = x * jnp.uint32(multipliers[0])
    x = x ^ (x >> shifts[1])
    x = x * jnp.uint32(multipliers[1])
    return x ^ (x >> shifts[2])


def uniform_noise(key_words: jax.Array, vocab_size: int) -> jax.Array:
    """float32[R, V] uniform in (0, 1), 24 random bits each, a function of (key_words[r], token)."""
    token = jax.lax.broadcasted_iota(jnp.uint32, (key_words.shape[0], vocab_size), 1)
    x = token * jnp.uint32(0x9E3779B9) + key_words[:, :1]
    x = _mix(x, (0x85EBCA6B, 0xC2B2AE35), (16, 13, 16))
    x = _mix(x ^ key_words[:, 1:], (0x7FEB352D, 0x846CA68B), (16, 15, 16))
    return ((x >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def random_sample(logits: jax.Array, key_words: jax.Array) -> jax.Array:
    """int32[R]: one draw per row from softmax(logits); -inf tokens are never drawn.

    Args:
      logits: float32[R, V].
      key_words: uint32[R, 2] from `row_keys`.
    """
    # No guard for all -inf rows (they draw token 0): clamping the max here is costly on XLA:CPU.
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # unnormalized probabilities
    exponential = -jnp.log(uniform_noise(key_words, logits.shape[1]))
    return first_argmax(weights / exponential)
