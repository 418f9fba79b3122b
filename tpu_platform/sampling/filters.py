# SPDX-License-Identifier: Apache-2.0
"""min-p, top-k and top-p for random rows, without sorting the vocabulary.

vLLM (`apply_top_k_top_p_pytorch`) sorts each row ascending, masks values below the k-th largest,
then masks the ascending prefix whose cumulative probability is <= 1 - p (the largest token always
survives). Equivalently, in descending order a token survives top-p iff the probability mass of the
tokens before it is < p. Both filters are therefore thresholds on the value, found here as uint32
"keys" that order like the float32 logits:

1. the top `TOP_CANDIDATES` logits of every row (`lax.top_k`) usually contain both thresholds;
2. rows where they do not (top_k beyond the candidates, or a nucleus wider than them) get exact
   thresholds by a 32-step bisection over the keys, under a `lax.cond` that only runs when some
   row needs it. A row's thresholds depend only on that row, so results stay batch invariant.

Ties at a threshold are all kept (vLLM's unstable sort keeps an arbitrary subset of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOP_CANDIDATES = 256
_NEG_INF = float("-inf")
_FLOAT_MIN = -3.4e38  # a row max clamped to this keeps exp(-inf - max) = 0 on all -inf rows


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """vLLM `MinPLogitsProcessor.apply`: tokens with prob < min_p * max prob become -inf."""
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = jnp.max(probs, axis=-1, keepdims=True) * min_p[:, None]
    return jnp.where(probs < threshold, _NEG_INF, logits)


def float_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of the float32 values (-inf smallest, +inf largest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key(predicate, rows: int) -> jax.Array:
    """Per row, the largest uint32 K with `predicate(K[:, None])` true (true at 0, monotone)."""

    def step(i, key):
        candidate = key | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        return jnp.where(predicate(candidate[:, None]), candidate, key)

    return jax.lax.fori_loop(0, 32, step, jnp.zeros(rows, jnp.uint32))


def _top_k_key(keys: jax.Array, candidate_keys: jax.Array, k: jax.Array) -> jax.Array:
    """Key of each row's k-th largest logit (k in [1, V])."""
    width = candidate_keys.shape[1]
    fast = jnp.take_along_axis(candidate_keys, jnp.clip(k - 1, 0, width - 1)[:, None], axis=1)[:, 0]
    fits = k <= width

    def exact():
        bisected = _largest_key(lambda c: jnp.sum(keys >= c, axis=1) >= k, keys.shape[0])
        return jnp.where(fits, fast, bisected)

    return jax.lax.cond(jnp.all(fits), lambda: fast, exact)


def _top_p_key(keys, weights, total, candidate_keys, candidate_weights, top_p) -> jax.Array:
    """Smallest key kept by top-p; `weights` are unnormalized probabilities already top-k masked."""
    width = candidate_keys.shape[1]
    limit = top_p * total
    before = jnp.cumsum(candidate_weights, axis=1) - candidate_weights  # mass ahead of each candidate
    count = jnp.sum(before < limit[:, None], axis=1)
    fast = jnp.take_along_axis(candidate_keys, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    disabled = top_p >= 1.0
    fits = disabled | (count < width) | (jnp.sum(candidate_weights, axis=1) >= limit)
    fast = jnp.where(disabled, jnp.uint32(0), fast)

    def exact():
        # The largest key whose strictly-higher tokens already hold mass >= p: drop it and below.
        def ahead_enough(c):
            return jnp.sum(jnp.where(keys > c, weights, 0.0), axis=1) >= limit

        return jnp.where(fits, fast, _largest_key(ahead_enough, keys.shape[0]) + 1)

    return jax.lax.cond(jnp.all(fits), lambda: fast, exact)


def apply_top_k_top_p(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *, candidates: int = TOP_CANDIDATES
) -> jax.Array:
    """vLLM top-k then top-p (see the module docstring); masked tokens become -inf.

    Args:
      logits: float32[R, V] (after temperature and min-p).
      top_k: int32[R]; <= 0 or >= V disables it.
      top_p: float32[R] in (0, 1]; 1 disables it.
      candidates: static width of the `lax.top_k` shortcut.
    """
    vocab = logits.shape[1]
    keys = float_keys(logits)
    values, _ = jax.lax.top_k(logits, min(candidates, vocab))  # [R, C] descending
    candidate_keys = float_keys(values)
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    k_key = _top_k_key(keys, candidate_keys, k)
    # Not values[:, :1]: reading the top_k output here makes XLA:CPU replace it by a full sort.
    row_max = jnp.maximum(jnp.max(logits, axis=1, keepdims=True), _FLOAT_MIN)
    weights = jnp.where(keys >= k_key[:, None], jnp.exp(logits - row_max), 0.0)
    candidate_weights = jnp.where(candidate_keys >= k_key[:, None], jnp.exp(values - row_max), 0.0)
    total = jnp.sum(weights, axis=1)
    p_key = _top_p_key(keys, weights, total, candidate_keys, candidate_weights, top_p)
    keep = (keys >= k_key[:, None]) & (keys >= p_key[:, None])
    return jnp.where(keep, logits, _NEG_INF)
