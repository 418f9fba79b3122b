# SPDX-License-Identifier: Apache-2.0
"""Independent greedy decoding with transformers (fp32, full recompute each token)."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The argmax continuation of `prompt_ids`, ignoring EOS."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids], dtype=torch.long)).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids) :]


def hf_greedy_with(model, prompt_ids: list[int], max_new_tokens: int, options) -> list[int]:
    """`hf_greedy` with `options` (`SamplingOptions`: penalties, logit bias, bad words, min_tokens,
    allowed ids) applied to each step's logits by the NumPy reference of vLLM's sampler."""
    from tpu_platform.sampling.reference import reference_row

    ids, output = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids], dtype=torch.long)).logits[0, -1].numpy()
            output.append(reference_row(logits, options, prompt_ids, output).greedy)
            ids.append(output[-1])
    return output
