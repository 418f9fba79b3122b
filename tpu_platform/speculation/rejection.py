# SPDX-License-Identifier: Apache-2.0
"""Draft verification: which drafted tokens the target model keeps, and the token it adds.

vLLM's rejection sampling (`vllm/v1/sample/rejection_sampler.py`) with n-gram drafts, whose
proposal q is one-hot on the draft. At drafted position j of a request (target distribution
p_j, after temperature, min-p and top-k/top-p, exactly as `sampling.sample` prepares it):

- greedy rows accept the draft while it equals argmax p_j;
- random rows accept it with probability min(1, p_j(d) / q(d)) = p_j(d);
- the first rejected position takes a token from norm(max(0, p_j - q)): p_j with the draft's
  probability zeroed; when every draft is accepted the next position adds a bonus token from its
  own p. The output therefore follows p exactly, and greedy output equals greedy decoding's.

Position j of a request draws with the key of its (num_generated + j)-th output token, so a
seeded request's draws depend on its seed and progress only; the acceptance test takes its
uniform from a key folded once more (independent of the draw at the same position).

With penalties, bad words, min_tokens, logit biases, allowed ids or grammars among the requests,
the sampling tensors come per position (`SamplingBatch.prepare_positions`: position j's history
holds the j drafts before it, as vLLM's rejection sampler counts them; a grammar's bitmask row is
its state after them, as vLLM's scheduler computes it) and those transforms apply to each
position's logits before the argmax and the distribution p_j.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpu_platform.sampling import SAMPLING_EPS, SamplerFlags, SamplingTensors, noise, ops
from tpu_platform.sampling.ops import first_argmax
from tpu_platform.sampling.sampler import process_logits, random_logits

# Folded into a position's key for its acceptance uniform.
_ACCEPT_SALT = 0x5EC0DE


def per_position(tensors: SamplingTensors, width: int) -> SamplingTensors:
    """`tensors` of R rows repeated for R * width positions (row r's position j at r * width + j),
    each position's draw keyed by its own output index (num_generated + j)."""
    repeated = jax.tree.map(lambda x: jnp.repeat(x, width, axis=0), tensors)
    if tensors.random is None:
        return repeated
    offsets = jnp.tile(jnp.arange(width, dtype=jnp.int32), tensors.temperature.shape[0])
    random = repeated.random
    random = type(random)(random.key_data, random.salt, random.num_generated + offsets)
    return SamplingTensors(temperature=repeated.temperature, random=random, filters=repeated.filters)


def accept_uniform(key_words: jax.Array) -> jax.Array:
    """float32[N] uniform in (0, 1): one per position, from its key folded with `_ACCEPT_SALT`."""
    keys = jax.random.wrap_key_data(key_words, impl="threefry2x32")
    folded = jax.random.key_data(jax.vmap(lambda k: jax.random.fold_in(k, _ACCEPT_SALT))(keys))
    return noise.uniform_noise(folded, 1)[:, 0]


@functools.partial(jax.jit, static_argnames=("flags",))
def verify_drafts(
    logits: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    tensors: SamplingTensors,
    *,
    flags: SamplerFlags,
) -> tuple[jax.Array, jax.Array]:
    """Accepts or rejects each request's drafts and appends one token.

    Args:
      logits: float[R, K + 1, V], row r's logits at its last known token and after each draft.
      drafts: int32[R, K] drafted ids (< 0: a placeholder, never accepted).
      num_drafts: int32[R] how many of row r's drafts are real (the rest are ignored).
      tensors: per-row sampling tensors (`SamplingBatch.prepare`, leading dim R; only
        temperature, the random keys and the filters are read), or per position (`prepare_positions`,
        leading dim R * (K + 1)) when `flags` turn on penalties, sparse entries, allowed ids or
        grammars.
      flags: static; `all_greedy`, `filters`, `penalties`, `sparse`, `allowed` and `grammar` are read.

    Returns:
      tokens int32[R, K + 1]: row r's output is `tokens[r, :counts[r]]` (its accepted drafts,
      then the token of the first rejected position or the bonus token); counts int32[R] in
      [1, num_drafts + 1].
    """
    rows, width, vocab = logits.shape
    k = width - 1
    flat = logits.reshape(rows * width, vocab).astype(jnp.float32)
    real = jnp.arange(k)[None, :] < num_drafts[:, None]
    # The draft at each position (-1: none, at the bonus position too).
    drafted = jnp.concatenate([jnp.where(real, drafts, -1), jnp.full((rows, 1), -1, drafts.dtype)], axis=1)
    extras = flags.penalties or flags.sparse or flags.allowed or flags.grammar
    if flags.grammar:  # first, as `sampling.sample` applies it
        flat = ops.apply_grammar_bitmask(flat, tensors.grammar_bitmask, tensors.grammar_rows)
    if extras:  # the tensors are per position already
        flat = process_logits(flat, tensors, flags)
    greedy = first_argmax(flat).reshape(rows, width)
    accept, token = greedy == drafted, greedy
    if not flags.all_greedy:
        expanded = tensors if extras else per_position(tensors, width)
        processed = random_logits(flat, expanded, SamplerFlags(filters=flags.filters))
        probs = jax.nn.softmax(processed, axis=-1)
        draft_flat = drafted.reshape(-1)
        draft_prob = jnp.take_along_axis(probs, jnp.maximum(draft_flat, 0)[:, None], axis=1)[:, 0]
        rnd = expanded.random
        keys = noise.row_keys(rnd.key_data, rnd.salt, rnd.num_generated)
        accepted_random = (draft_flat >= 0) & (accept_uniform(keys) < draft_prob)
        # The draft's probability zeroed: a draw from norm(max(0, p - q)).
        vocab_ids = jax.lax.broadcasted_iota(jnp.int32, processed.shape, 1)
        without_draft = jnp.where(vocab_ids == draft_flat[:, None], -jnp.inf, processed)
        drawn = noise.random_sample(without_draft, keys).reshape(rows, width)
        is_greedy = (expanded.temperature < SAMPLING_EPS).reshape(rows, width)
        accept = jnp.where(is_greedy, accept, accepted_random.reshape(rows, width))
        token = jnp.where(is_greedy, greedy, drawn)
    # Drafts kept: the leading accepted ones.
    kept = jnp.sum(jnp.cumprod(accept[:, :k].astype(jnp.int32), axis=1), axis=1)
    position = jnp.arange(width)[None, :]
    tokens = jnp.where(position < kept[:, None], drafted, token)
    return tokens.astype(jnp.int32), (kept + 1).astype(jnp.int32)


def position_logprobs(
    logits: jax.Array, tokens: jax.Array, tensors: SamplingTensors, *, flags: SamplerFlags
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each verified position's logprobs of its output token, as `sampling.sample` gives a sampled
    row's: from the logits as they come (`raw_*` modes) or as processed for the draw
    (`processed_*`: the options, then temperature and the filters), as log-probabilities or
    logits; per position tensors (`prepare_positions`).

    Args:
      logits: float[R, K + 1, V], as `verify_drafts` takes them.
      tokens: int32[R, K + 1], `verify_drafts`' output tokens (past a row's count: ignored).
      tensors: per-position sampling tensors (leading dim R * (K + 1)).
      flags: static; `num_logprobs` (N) set, and the options `verify_drafts` applies.

    Returns:
      ids int32[R * (K + 1), N + 1], logprobs float32[R * (K + 1), N + 1] (the token first) and
      its ranks int32[R * (K + 1)], row r's position j at r * (K + 1) + j.
    """
    rows, width, vocab = logits.shape
    source = logits.reshape(rows * width, vocab).astype(jnp.float32)
    if flags.grammar:
        source = ops.apply_grammar_bitmask(source, tensors.grammar_bitmask, tensors.grammar_rows)
    if not flags.logprobs_mode.startswith("raw"):
        source = process_logits(source, tensors, flags)
        if not flags.all_greedy:
            source = random_logits(source, tensors, SamplerFlags(filters=flags.filters))
    if flags.logprobs_mode.endswith("logprobs"):
        source = ops.compute_logprobs(source)
    return ops.gather_logprobs(source, tokens.reshape(-1), flags.num_logprobs)
