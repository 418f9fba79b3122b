# SPDX-License-Identifier: Apache-2.0
"""The n-gram (prompt lookup) proposer, vectorized over requests in NumPy.

vLLM's semantics (`vllm/v1/spec_decode/ngram_proposer.py`): find the longest suffix of a
request's tokens, between `min_n` and `max_n` tokens long, that also occurs earlier (an
occurrence may overlap the suffix but must end before the last token); among occurrences of
that length take the earliest; propose the up to k tokens that follow it, no more than the
history holds after it and no more than `max_model_len` leaves room for.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(
    token_ids: np.ndarray,
    num_tokens: np.ndarray,
    *,
    k: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> list[list[int]]:
    """Drafts for each request.

    Args:
      token_ids: int[B, L] each request's tokens (prompt then outputs), L >= max(num_tokens).
      num_tokens: int[B] how many of each row are known.
      k, min_n, max_n, max_model_len: as in vLLM's `speculative_config` and model config.

    Returns:
      B lists of up to k proposed token ids (empty where nothing matches).
    """
    count = np.asarray(num_tokens, np.int64)
    batch = count.size
    if batch == 0:
        return []
    length = int(count.max())
    tokens = np.asarray(token_ids)[:, :length]
    ends = np.arange(length)  # [E] an occurrence's last index
    # matched[b, l, e]: token e - l equals token count - 1 - l (the suffix read backwards).
    matched = np.zeros((batch, max_n, length), bool)
    for back in range(max_n):
        suffix_index = np.maximum(count - 1 - back, 0)
        suffix = tokens[np.arange(batch), suffix_index]  # [B]
        shifted = np.full((batch, length), -1, np.int64)
        shifted[:, back:] = tokens[:, : length - back]  # token e - back
        matched[:, back] = (shifted == suffix[:, None]) & (ends >= back)[None]
    # Match length of the occurrence ending at e (capped at max_n and at the suffix's length).
    run = np.cumprod(matched, axis=1).sum(axis=1)  # [B, E]
    run = np.minimum(run, count[:, None])
    run[ends[None, :] >= (count - 1)[:, None]] = 0  # occurrences end before the last token
    longest = run.max(axis=1)
    first_end = np.argmax(run == longest[:, None], axis=1)  # the earliest of the longest
    starts = first_end + 1
    budget = np.minimum(np.minimum(k, max_model_len - count), count - starts)
    found = (longest >= min_n) & (count >= min_n) & (budget > 0)
    drafts = []
    for b in range(batch):
        if found[b]:
            drafts.append(tokens[b, starts[b] : starts[b] + budget[b]].tolist())
        else:
            drafts.append([])
    return drafts
