# SPDX-License-Identifier: Apache-2.0
"""What the speculative-decoding engine tests share: vLLM's own spec-decode counters, an engine
held to zero compiles after warm-up, and the greedy run the MTP engine tests compare with
transformers (prompts prefilled at once and in chunks under a 16-token step budget)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import numpy as np
import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.greedy_reference import hf_greedy


def spec_counters(llm: LLM) -> tuple[float, float, float]:
    """vLLM's draft tokens, accepted tokens, and accepted tokens summed over draft positions (zeros
    before any step drafted)."""
    metrics = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")}
    by_position = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return (
        metrics["vllm:spec_decode_num_draft_tokens"].value if metrics else 0,
        metrics["vllm:spec_decode_num_accepted_tokens"].value if metrics else 0,
        sum(by_position.values) if by_position is not None else 0,
    )


@contextlib.contextmanager
def strict_compile_engine(**engine_args) -> Iterator[LLM]:
    """`vllm.LLM(**engine_args)` with `VLLM_XLA_STRICT_COMPILE=1` (a compile after warm-up fails
    the step), released when the block ends."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_XLA_STRICT_COMPILE", "1")
    engine = LLM(**engine_args)
    try:
        yield engine
    finally:
        del engine
        gc.collect()
        mp.undo()


def greedy_run_equals_reference(
    llm: LLM, hf, new_tokens: int, lengths: tuple[int, ...] = (9, 15, 26)
) -> dict:
    """Prompts of `lengths` tokens (under a 16-token step budget, 26 and more prefilled in chunks)
    decoded greedily through `llm` equal `hf`'s greedy decoding token for token; vLLM's accepted
    count equals the runner's, it drafted at least as many, a prefill was chunked and nothing
    compiled after warm-up. Returns the runner's stats."""
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(3, 384, n - 1).tolist()] for n in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
    expected = [hf_greedy(hf.eval(), p, new_tokens) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    stats = llm.collective_rpc("runner_stats")[0]
    assert stats["verified_steps"] > 0
    drafted, accepted, _ = spec_counters(llm)
    assert accepted == stats["accepted_tokens"]
    assert drafted >= stats["draft_tokens"]
    assert stats["partial_prefill_steps"] > 0
    assert stats["compiles_after_warmup"] == 0
    return stats
