# SPDX-License-Identifier: Apache-2.0
"""`sample`: logits to tokens (and logprobs) in one jitted function, in vLLM v1 `Sampler` order.

0. structured-output grammar bitmask (vLLM applies it in the model runner, before the sampler)
1. logprobs of the logits as they are now (vLLM's default `raw_logprobs`)
2. allowed_token_ids, 3. bad words, 4. min_tokens, 5. logit_bias, 6. penalties
7. greedy argmax; for random rows: temperature, min_p, top-k/top-p, Gumbel-max draw
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpu_platform.sampling import filters, noise, ops
from tpu_platform.sampling.options import SAMPLING_EPS
from tpu_platform.sampling.tensors import SamplerFlags, SamplerOutput, SamplingTensors


def _check_tensors(tensors: SamplingTensors, flags: SamplerFlags) -> None:
    needed = {
        "random": not flags.all_greedy,
        "filters": flags.filters,
        "penalties": flags.penalties,
        "sparse": flags.sparse,
        "allowed_bitmask": flags.allowed,
        "grammar_bitmask": flags.grammar,
    }
    for name, wanted in needed.items():
        if wanted and getattr(tensors, name) is None:
            raise ValueError(f"SamplerFlags ask for {name!r} but SamplingTensors.{name} is None")


def process_logits(logits: jax.Array, tensors: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    """Steps 2-6: the argmax-changing transforms (allowed ids, bad words, min_tokens, bias, penalties)."""
    if flags.allowed:
        logits = ops.apply_grammar_bitmask(logits, tensors.allowed_bitmask)
    if flags.sparse:
        sparse = tensors.sparse
        logits = ops.apply_bad_words(logits, sparse.token_ids, sparse.kinds)
        logits = ops.apply_min_tokens(logits, sparse.token_ids, sparse.kinds, sparse.restore_stops)
        logits = ops.apply_logit_bias(logits, sparse.token_ids, sparse.values, sparse.kinds)
    if flags.penalties:
        pen = tensors.penalties
        logits = ops.apply_penalties(
            logits, pen.token_ids, pen.prompt_len, pen.length, pen.presence, pen.frequency, pen.repetition
        )
    return logits


def random_logits(logits: jax.Array, tensors: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    """Step 7 for random rows: temperature, then min_p, then top-k/top-p (what gets sampled from)."""
    logits = ops.apply_temperature(logits, tensors.temperature)
    if flags.filters:
        logits = filters.apply_min_p(logits, tensors.filters.min_p)
        logits = filters.apply_top_k_top_p(logits, tensors.filters.top_k, tensors.filters.top_p)
    return logits


@functools.partial(jax.jit, static_argnames=("flags",))
def sample(logits: jax.Array, tensors: SamplingTensors, *, flags: SamplerFlags) -> SamplerOutput:
    """Samples one token per row with vLLM v1 semantics.

    Args:
      logits: float[R, V] (any float dtype; computed in float32).
      tensors: per-row parameters from `SamplingBatch.prepare` (leading dim R).
      flags: static switches from the same call.

    Returns:
      `SamplerOutput`: int32[R] tokens, plus [R, N + 1] logprob ids/values and int32[R] ranks when
      `flags.num_logprobs` is set. Padding rows are greedy and their outputs meaningless.
    """
    _check_tensors(tensors, flags)
    logits = logits.astype(jnp.float32)
    if flags.grammar:
        logits = ops.apply_grammar_bitmask(logits, tensors.grammar_bitmask, tensors.grammar_rows)
    raw = logits
    logits = process_logits(logits, tensors, flags)
    greedy = ops.greedy_sample(logits)
    if flags.all_greedy:
        sampled, processed = greedy, logits
    else:
        processed = random_logits(logits, tensors, flags)
        rnd = tensors.random
        drawn = noise.random_sample(processed, noise.row_keys(rnd.key_data, rnd.salt, rnd.num_generated))
        sampled = jnp.where(tensors.temperature < SAMPLING_EPS, greedy, drawn)
    if flags.num_logprobs is None:
        return SamplerOutput(sampled_token_ids=sampled)
    source = raw if flags.logprobs_mode.startswith("raw") else processed
    if flags.logprobs_mode.endswith("logprobs"):
        source = ops.compute_logprobs(source)
    ids, values, ranks = ops.gather_logprobs(source, sampled, flags.num_logprobs)
    return SamplerOutput(
        sampled_token_ids=sampled, logprob_token_ids=ids, logprobs=values, sampled_token_ranks=ranks
    )


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def prompt_logprobs(
    logits: jax.Array, token_ids: jax.Array, *, num_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """vLLM prompt logprobs: raw log_softmax of each position's logits, gathered like sampled ones.

    Args:
      logits: float[T, V], the logits at prompt positions.
      token_ids: int32[T], the next prompt token of each position.
      num_logprobs: static N (the vocabulary size for -1).

    Returns:
      ids int32[T, N + 1], logprobs float32[T, N + 1] (the prompt token first) and ranks int32[T].
    """
    return ops.gather_logprobs(ops.compute_logprobs(logits), token_ids, num_logprobs)
