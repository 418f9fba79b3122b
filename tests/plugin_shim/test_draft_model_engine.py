# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding with a draft model through vLLM's real engine: greedy output equals
transformers' greedy decoding token for token (so equals decoding without speculation), under
chunked prefill and preemption, with drafts both kept and rejected; a draft identical to the
target has every draft accepted, prefix-cache hits included (its cache holds the right tokens at
the right positions of the target's pages); vLLM's spec-decode counters agree; nothing compiles
after warm-up."""

import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.greedy_reference import hf_greedy
from tests.speculation_engine import spec_counters
from tests.tiny_models import save_damped_tiny_llama

pytestmark = pytest.mark.slow  # builds vllm.LLM

NEW_TOKENS = 32
K = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny Llama whose layers' outputs are scaled down: a draft made of its first layer alone
    agrees with it on most tokens, not all."""
    return save_damped_tiny_llama(str(tmp_path_factory.mktemp("draft_target")), seed=5, scale=0.05)


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    """The target's first layer, embedding, norm and head: a one-layer draft of its vocabulary."""
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    path = str(tmp_path_factory.mktemp("draft_one_layer"))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def hf(target_dir):
    return LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)


def _engine(target, draft, **overrides):
    kwargs = dict(
        model=target, tokenizer=target, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
        block_size=16, seed=0, disable_log_stats=False,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K},
    )  # fmt: skip
    kwargs.update(overrides)
    return LLM(**kwargs)


@pytest.fixture(scope="module")
def llm(target_dir, draft_dir):
    # A 16-token step budget chunks every prompt; 14 pages of 16 tokens cannot hold four
    # sequences of ~60 tokens (and their lookahead slots) at once: the scheduler preempts.
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_XLA_STRICT_COMPILE", "1")
    engine = _engine(target_dir, draft_dir, num_gpu_blocks_override=14)
    yield engine
    del engine
    gc.collect()
    mp.undo()


def _prompts(seed, count=4):
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, 384, int(rng.integers(12, 30))).tolist()] for _ in range(count)]


def _generate(llm, prompts, params):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _stats(llm):
    return llm.collective_rpc("runner_stats")[0]


def test_greedy_with_a_draft_model_equals_greedy_decoding(llm, hf):
    before, vllm_before = _stats(llm), spec_counters(llm)
    prompts = _prompts(seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert _generate(llm, prompts, greedy) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    after, vllm_after = _stats(llm), spec_counters(llm)
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert 0 < accepted < drafted  # drafts kept and drafts rejected
    assert vllm_after[1] - vllm_before[1] == accepted  # vLLM's SpecDecodingStats agree
    assert after["partial_prefill_steps"] > before["partial_prefill_steps"]
    assert after["preempted_requests"] > before["preempted_requests"]
    assert after["compiles_after_warmup"] == 0


def test_a_draft_identical_to_the_target_has_every_draft_accepted(target_dir, hf):
    # The second batch's prompts begin with the first's 32 tokens (two whole pages): the engine
    # serves them from its prefix cache, pages the draft's forward filled for the first prompt.
    engine = _engine(target_dir, target_dir, enable_prefix_caching=True)
    try:
        first, *others = _prompts(seed=1, count=3)
        shared = [*first, *_prompts(seed=2, count=1)[0]][:32]
        batches = [[shared + first[1:9]], [shared + other[1:] for other in others]]
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for prompts in batches:
            assert _generate(engine, prompts, greedy) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        stats = _stats(engine)
        assert stats["prefix_cache_hits"] >= 2
        assert stats["draft_tokens"] > 0
        assert stats["accepted_tokens"] == stats["draft_tokens"]  # acceptance rate 1.0
        vllm_drafted, vllm_accepted, _ = spec_counters(engine)
        assert vllm_accepted == stats["accepted_tokens"]
        assert vllm_drafted >= stats["draft_tokens"]  # vLLM also counts drafts past max_tokens
        assert stats["compiles_after_warmup"] == 0
    finally:
        del engine
        gc.collect()
