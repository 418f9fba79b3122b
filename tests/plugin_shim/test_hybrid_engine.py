# SPDX-License-Identifier: Apache-2.0
"""Qwen3-Next and Qwen3.5 (Gated DeltaNet beside full attention) through vLLM's real engine,
against transformers greedy decoding: prompts longer than a step's 32 tokens (chunked prefill
carries the states from chunk to chunk), several at once of different lengths, in 13 usable
blocks (a request takes one a state layer beside its KV pages: the scheduler preempts, and the
preempted requests recompute their states when resumed), requests after finished ones (their
state slots reused: a fresh request starts from zero states), all under
VLLM_XLA_STRICT_COMPILE=1 (no compile after warm-up)."""

import gc

import numpy as np
import pytest
import torch
import transformers
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.greedy_reference import hf_greedy
from tests.models.tiny_qwen3_next import RELEASED, save_tiny_qwen3_5_multimodal, save_tiny_qwen3_next

pytestmark = pytest.mark.slow  # builds vllm.LLM

NEW_TOKENS = 10
# (architecture, seed): Qwen3-Next's two input projections and MoE, Qwen3.5's four and dense MLPs,
# as released (its text model under a vision tower).
_MODELS = [("Qwen3NextForCausalLM", 3), ("Qwen3_5ForConditionalGeneration", 4)]


@pytest.fixture(scope="module", params=_MODELS, ids=[arch for arch, _ in _MODELS])
def served(request, tmp_path_factory):
    """(engine, transformers model), one engine per architecture."""
    architecture, seed = request.param
    path = str(tmp_path_factory.mktemp(architecture))
    if architecture in RELEASED:
        save_tiny_qwen3_5_multimodal(path, architecture, seed=seed)
    else:
        save_tiny_qwen3_next(path, seed=seed, architecture=architecture)
    hf = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_XLA_STRICT_COMPILE", "1")
        # 16-token pages; 14 blocks (one the engine keeps back): a 128-token request needs 8 KV
        # pages and 3 state blocks, so a few long requests at once exceed them.
        engine = LLM(
            model=path, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
            num_gpu_blocks_override=14, seed=0,
        )  # fmt: skip
        yield engine, hf
        del engine
        gc.collect()


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, 384, n - 1).tolist()] for n in lengths]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_chunked_prompts_at_once_match_transformers_through_preemption(served):
    llm, hf = served
    before = llm.collective_rpc("runner_stats")[0]
    prompts = _prompts([75, 5, 40, 61], seed=1)
    assert _generate(llm, prompts) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    stats = llm.collective_rpc("runner_stats")[0]
    assert stats["partial_prefill_steps"] > before["partial_prefill_steps"]  # prompts were chunked
    assert stats["preempted_requests"] > before["preempted_requests"]  # and some recomputed
    assert stats["compiles_after_warmup"] == 0


def test_requests_after_finished_ones_start_from_zero_states(served):
    llm, hf = served
    # Each round's 4 requests take more than the 13 blocks (preempted ones give theirs up, finished
    # ones free theirs), so within a round and in the next, slots that held a state are handed
    # out again.
    for round_ in range(2):
        prompts = _prompts([9, 17, 3, 26], seed=10 + round_)
        assert _generate(llm, prompts) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert llm.collective_rpc("runner_stats")[0]["compiles_after_warmup"] == 0
