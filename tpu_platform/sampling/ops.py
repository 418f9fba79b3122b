# SPDX-License-Identifier: Apache-2.0
"""Pure jnp logits transforms, one per vLLM sampler step, each `logits[R, V] -> logits[R, V]`.

Each mirrors the vLLM v1 code named in its docstring (float32 throughout, -inf for masked tokens).
Per-row parameters are arrays and neutral values (top_k = V, top_p = 1, min_p = 0, penalties 0/0/1,
no sparse entries, all bitmask bits set) leave a row unchanged, so one program serves every batch.
Token-id lists arrive compact (`[R, L]`, `[R, B]`) and are scattered into `[R, V]` here, on device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_platform.sampling.options import SAMPLING_EPS
from tpu_platform.sampling.tensors import KIND_BAN, KIND_BIAS, KIND_STOP

_NEG_INF = float("-inf")


def _row_index(token_ids: jax.Array) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, token_ids.shape, 0)


def _row_scatter_add(size: int, token_ids: jax.Array, values: jax.Array) -> jax.Array:
    """`out[r, token_ids[r, j]] += values[r, j]` into zeros `[R, size]`; ids outside [0, size) are dropped."""
    out = jnp.zeros((token_ids.shape[0], size), values.dtype)
    return out.at[_row_index(token_ids), token_ids].add(values, mode="drop")


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """`bool[R, min(V, 32 W)]` from `int32[R, W]`: token `t` is bit `t % 32` of word `t // 32`."""
    rows, words = bitmask.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    return bits.reshape(rows, words * 32)[:, : min(vocab_size, words * 32)] != 0


def apply_grammar_bitmask(
    logits: jax.Array, bitmask: jax.Array, has_mask: jax.Array | None = None
) -> jax.Array:
    """xgrammar `apply_token_bitmask_inplace`: tokens whose bit is 0 become -inf.

    Args:
      logits: float32[R, V].
      bitmask: int32[R, W], set bit = allowed. Only the first min(V, 32 W) tokens are touched (the
        xgrammar convention when the bitmask is narrower than the logits).
      has_mask: optional bool[R]; rows where it is False are left unchanged (vLLM instead fills
        such rows with -1, which is equivalent).
    """
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if has_mask is not None:
        allowed = allowed | ~has_mask[:, None]
    width = allowed.shape[1]
    masked = jnp.where(allowed, logits[:, :width], _NEG_INF)
    if width == logits.shape[1]:
        return masked
    return jnp.concatenate([masked, logits[:, width:]], axis=1)


def apply_bad_words(logits: jax.Array, token_ids: jax.Array, kinds: jax.Array) -> jax.Array:
    """vLLM `apply_bad_words`: the KIND_BAN entries (computed on the host from the history) become -inf."""
    banned = _row_scatter_add(logits.shape[1], token_ids, (kinds == KIND_BAN).astype(jnp.int32)) > 0
    return jnp.where(banned, _NEG_INF, logits)


def apply_min_tokens(
    logits: jax.Array, token_ids: jax.Array, kinds: jax.Array, restore_rows: jax.Array
) -> jax.Array:
    """vLLM `MinTokensLogitsProcessor.apply`: KIND_STOP entries become -inf.

    For `restore_rows` (structured output) whose every logit is then -inf, the stop tokens that were
    finite before get their value back (`_mask_stop_token_logits`).
    """
    vocab = logits.shape[1]
    is_stop = kinds == KIND_STOP
    stop_hits = _row_scatter_add(vocab, token_ids, is_stop.astype(jnp.int32)) > 0
    before = jnp.take_along_axis(logits, jnp.clip(token_ids, 0, vocab - 1), axis=1)  # [R, B]
    masked = jnp.where(stop_hits, _NEG_INF, logits)
    row_dead = jnp.all(masked == _NEG_INF, axis=1)
    restore = is_stop & (restore_rows & row_dead)[:, None] & jnp.isfinite(before)
    restore_ids = jnp.where(restore, token_ids, vocab)
    restore_hits = _row_scatter_add(vocab, restore_ids, jnp.ones_like(restore_ids)) > 0
    restored = jnp.zeros_like(logits).at[_row_index(restore_ids), restore_ids].set(before, mode="drop")
    return jnp.where(restore_hits, restored, masked)


def apply_logit_bias(
    logits: jax.Array, token_ids: jax.Array, values: jax.Array, kinds: jax.Array
) -> jax.Array:
    """vLLM `LogitBiasLogitsProcessor.apply`: `logits[r, id] += bias` for KIND_BIAS entries."""
    bias = jnp.where(kinds == KIND_BIAS, values, 0.0).astype(logits.dtype)
    return logits + _row_scatter_add(logits.shape[1], token_ids, bias)


def apply_penalties(
    logits: jax.Array,
    token_ids: jax.Array,
    prompt_len: jax.Array,
    length: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
) -> jax.Array:
    """vLLM `apply_penalties`: repetition over prompt and output tokens, then frequency and presence
    over output tokens only.

    Args:
      logits: float32[R, V].
      token_ids: int32[R, L]; per row, columns [0, prompt_len) are prompt tokens and
        [prompt_len, length) output tokens; ids outside [0, V) are ignored.
      prompt_len, length: int32[R].
      presence, frequency, repetition: float32[R].
    """
    vocab = logits.shape[1]
    column = jnp.arange(token_ids.shape[1], dtype=jnp.int32)[None, :]
    valid = (column < length[:, None]) & (token_ids >= 0) & (token_ids < vocab)
    is_output = column >= prompt_len[:, None]
    # One scatter over [R, 2V]: prompt tokens count in [0, V), output tokens in [V, 2V).
    slot = jnp.where(valid, token_ids + vocab * is_output.astype(jnp.int32), 2 * vocab)
    counts = _row_scatter_add(2 * vocab, slot, jnp.ones_like(slot))
    prompt_mask = counts[:, :vocab] > 0
    output_counts = counts[:, vocab:]
    output_mask = output_counts > 0
    penalty = jnp.where(prompt_mask | output_mask, repetition[:, None], 1.0)
    logits = logits * jnp.where(logits > 0, 1.0 / penalty, penalty)
    logits = logits - frequency[:, None] * output_counts.astype(logits.dtype)
    return logits - presence[:, None] * output_mask.astype(logits.dtype)


def apply_temperature(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """vLLM `Sampler.apply_temperature`; greedy rows (temperature < eps) are divided by 1."""
    temperature = jnp.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits / temperature[:, None].astype(logits.dtype)


_ARGMAX_BLOCK = 1024


def first_argmax(x: jax.Array) -> jax.Array:
    """`argmax(x, axis=-1)` of `[R, V]` (first index among ties) as int32, in two stages.

    The maximum of each block of 1024 values, the first block holding the row's maximum, then the
    first maximum inside it: the same index as `jnp.argmax`, which XLA:CPU reduces an order of
    magnitude more slowly over a vocabulary-wide row.
    """
    rows, width = x.shape
    blocks = -(-width // _ARGMAX_BLOCK)
    if blocks < 2:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    pad = blocks * _ARGMAX_BLOCK - width
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    x = x.reshape(rows, blocks, _ARGMAX_BLOCK)
    block = jnp.argmax(jnp.max(x, axis=-1), axis=-1)  # [R]
    inside = jnp.argmax(jnp.take_along_axis(x, block[:, None, None], axis=1)[:, 0], axis=-1)
    return (block * _ARGMAX_BLOCK + inside).astype(jnp.int32)


def greedy_sample(logits: jax.Array) -> jax.Array:
    """argmax, first index among ties (like torch). Returns int32[R]."""
    return first_argmax(logits)


def compute_logprobs(logits: jax.Array) -> jax.Array:
    """vLLM `Sampler.compute_logprobs`: float32 log_softmax over the vocabulary."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def gather_logprobs(
    logprobs: jax.Array, token_ids: jax.Array, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """vLLM `Sampler.gather_logprobs` (also what prompt logprobs use).

    Args:
      logprobs: float32[R, V].
      token_ids: int32[R], the sampled (or prompt) token of each row.
      num_logprobs: static N >= 0.

    Returns:
      ids int32[R, N + 1] and logprobs float32[R, N + 1] (the token first, then the top N, highest
      first, lower id first among ties) and the token's rank int32[R] (#tokens with logprob >= its own).
    """
    token_ids = token_ids.astype(jnp.int32)[:, None]
    token_logprobs = jnp.take_along_axis(logprobs, token_ids, axis=1)
    ranks = jnp.sum(logprobs >= token_logprobs, axis=-1, dtype=jnp.int32)
    if num_logprobs == 0:
        return token_ids, token_logprobs, ranks
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    ids = jnp.concatenate([token_ids, top_ids.astype(jnp.int32)], axis=1)
    return ids, jnp.concatenate([token_logprobs, top_logprobs], axis=1), ranks
