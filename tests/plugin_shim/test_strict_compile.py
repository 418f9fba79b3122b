# SPDX-License-Identifier: Apache-2.0
"""After warm-up, a mixed serving workload compiles nothing (VLLM_XLA_STRICT_COMPILE=1 raises).

Every sampling option is in the mix: greedy, seeds, top-k/top-p/min-p, logprobs, penalties,
logit_bias, min_tokens, bad words, allowed ids and a JSON-schema grammar.
"""

import gc

import numpy as np
import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # builds vllm.LLM


def _mixed_params(rng, n):
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, seed=int(rng.integers(1 << 30))),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.9, top_p=0.8, min_p=0.05),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=1.2, top_k=20, top_p=0.9, logprobs=1),
        dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        dict(temperature=0.8, logit_bias={7: 3.0, 9: -2.0}, min_tokens=4, seed=5),
        dict(temperature=0.0, bad_words=["hello", "the quick"], allowed_token_ids=list(range(3, 300))),
        dict(
            temperature=0.5,
            structured_outputs=StructuredOutputsParams(json={"type": "string", "enum": ["a", "b"]}),
        ),
    ]
    return [
        SamplingParams(max_tokens=int(rng.integers(8, 28)), ignore_eos=True, **kinds[int(k)])
        for k in rng.permutation(np.arange(n) % len(kinds))
    ]


def test_mixed_workload_compiles_nothing_after_warm_up(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_XLA_STRICT_COMPILE", "1")
    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=2, max_position_embeddings=128)
    # A small step budget (chunked prefill) and 12 pages of 16 tokens (preemption) with up to 6
    # sequences.
    llm = LLM(
        model=model_dir, max_model_len=128, max_num_seqs=6, max_num_batched_tokens=32,
        block_size=16, num_gpu_blocks_override=12, seed=0,
    )  # fmt: skip
    warm = llm.collective_rpc("runner_stats")[0]
    rng = np.random.default_rng(0)
    for batch_size in (1, 3, 6, 10, 12):
        lengths = rng.integers(1, 96, batch_size)
        prompts = [TokensPrompt(prompt_token_ids=[1, *rng.integers(3, 384, n - 1).tolist()]) for n in lengths]
        outputs = llm.generate(prompts, _mixed_params(rng, batch_size), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)
    stats = llm.collective_rpc("runner_stats")[0]
    del llm
    gc.collect()
    assert stats["compiles_after_warmup"] == 0
    assert stats["compiles"] == warm["compiles"]
    assert stats["partial_prefill_steps"] > 0 and stats["preempted_requests"] > 0
