# SPDX-License-Identifier: Apache-2.0
"""n-gram speculative decoding through vLLM's real engine: greedy output equals transformers'
greedy decoding token for token (so equals decoding without speculation), under chunked prefill
and preemption, with drafts both kept and rejected; random sampling is reproducible from a seed;
nothing compiles after warm-up."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

from tests.greedy_reference import hf_greedy, hf_greedy_with
from tests.plugin_shim.tensor_parallel_engine import environment
from tests.speculation_engine import spec_counters, strict_compile_engine
from tests.tiny_models import save_damped_tiny_llama
from tpu_platform.sampling import SamplingOptions

pytestmark = pytest.mark.slow  # builds vllm.LLM

NEW_TOKENS = 40
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama whose attention and MLP outputs are scaled down: its greedy text falls into
    loops an n-gram can predict, while every layer still changes the logits (some drafts fail)."""
    return save_damped_tiny_llama(str(tmp_path_factory.mktemp("spec_llama")), seed=2, scale=0.02)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    # A 16-token step budget chunks every prompt; 10 pages of 16 tokens cannot hold four
    # sequences of 80 tokens at once, so the scheduler preempts and recomputes.
    with strict_compile_engine(
        model=tiny_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=16,
        num_gpu_blocks_override=10, seed=0, speculative_config=SPECULATIVE, disable_log_stats=False,
    ) as engine:  # fmt: skip
        yield engine


def _prompts(seed, count=4):
    """Prompts that repeat a span: drafts exist from the first output token."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        span = rng.integers(3, 384, int(rng.integers(5, 12))).tolist()
        prompts.append([1, *span, *span, *span[:3]])
    return prompts


def _generate(llm, prompts, params):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _stats(llm):
    return llm.collective_rpc("runner_stats")[0]


def test_greedy_with_ngram_drafts_equals_greedy_decoding(llm, hf):
    before = _stats(llm)
    prompts = _prompts(seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert _generate(llm, prompts, greedy) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    after = _stats(llm)
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert 0 < accepted < drafted  # drafts kept and drafts rejected
    assert after["partial_prefill_steps"] > before["partial_prefill_steps"]
    assert after["preempted_requests"] > before["preempted_requests"]
    assert after["compiles_after_warmup"] == 0


def test_vllms_spec_decode_metrics_count_the_drafts_verified_and_kept(llm):
    before, vllm_before = _stats(llm), spec_counters(llm)
    prompts = _prompts(seed=3, count=2)
    _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    after, vllm_after = _stats(llm), spec_counters(llm)
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert accepted > 0
    # vLLM's scheduler counts from the tokens each step returned: the same acceptance; its draft
    # count also holds drafts a step did not verify (none here) and the placeholders it pads with.
    assert vllm_after[1] - vllm_before[1] == accepted
    assert vllm_after[2] - vllm_before[2] == accepted
    assert vllm_after[0] - vllm_before[0] >= after["draft_tokens"] - before["draft_tokens"]


def test_penalties_and_allowed_ids_apply_at_every_drafted_position(llm, hf):
    # Requests with penalties or allowed ids are drafted and their drafts verified with those
    # options at every position: greedy output equals greedy decoding with them (transformers'
    # logits through the NumPy reference of vLLM's sampler). vLLM refuses logit_bias and min_p
    # with speculative decoding; each position's history (the drafts before it), bad words and
    # min_tokens: `tests/tpu_platform/test_verify_options.py`.
    prompts = _prompts(seed=4, count=3)
    options = [
        SamplingOptions(temperature=0.0, presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.1),
        SamplingOptions(temperature=0.0, repetition_penalty=1.3),
        SamplingOptions(temperature=0.0, allowed_token_ids=tuple(range(3, 300)), frequency_penalty=0.3),
    ]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, presence_penalty=o.presence_penalty,
            frequency_penalty=o.frequency_penalty, repetition_penalty=o.repetition_penalty,
            allowed_token_ids=list(o.allowed_token_ids) if o.allowed_token_ids else None,
        )
        for o in options
    ]  # fmt: skip
    before = _stats(llm)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    expected = [hf_greedy_with(hf, p, NEW_TOKENS, o) for p, o in zip(prompts, options, strict=True)]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    after = _stats(llm)
    assert after["accepted_tokens"] > before["accepted_tokens"]
    assert after["unverified_steps"] == before["unverified_steps"]
    assert after["compiles_after_warmup"] == 0


def test_logprobs_are_those_of_every_drafted_position(llm, hf):
    # A request with logprobs is drafted; each of its tokens, kept drafts too, carries the
    # target's log-probabilities at its position (transformers', raw: vLLM's default mode).
    prompts = _prompts(seed=1, count=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    ]
    before = _stats(llm)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    after = _stats(llm)
    assert after["accepted_tokens"] > before["accepted_tokens"]
    assert after["unverified_steps"] == before["unverified_steps"]
    with torch.no_grad():
        sequence = torch.tensor([prompts[1] + tokens[1]])
        expected = torch.log_softmax(hf(sequence).logits[0, len(prompts[1]) - 1 : -1].float(), -1).numpy()
    logprobs = outputs[1].outputs[0].logprobs
    assert len(logprobs) == NEW_TOKENS
    for position, (token, entry) in enumerate(zip(tokens[1], logprobs, strict=True)):
        top = np.argsort(-expected[position], kind="stable")[:2].tolist()
        assert set(entry) == {token, *top}
        for t, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(expected[position, t]), abs=1e-4)
    assert after["compiles_after_warmup"] == 0


def test_a_grammars_drafts_are_verified_with_its_state_at_each_position(llm, tiny_dir):
    # A request with a grammar is drafted; each verified position is masked by the grammar's
    # state after the drafts before it (vLLM's bitmask rows): its greedy output equals an engine's
    # without speculation, where vLLM accepts every token it emits.
    prompts = _prompts(seed=5, count=2)
    grammar = StructuredOutputsParams(regex="[ab]{30}")  # many steps, loops n-grams predict
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, structured_outputs=grammar),
    ]
    before = _stats(llm)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    after = _stats(llm)
    assert after["accepted_tokens"] > before["accepted_tokens"]
    assert after["compiles_after_warmup"] == 0
    assert outputs[1].outputs[0].finish_reason == "stop"  # the grammar ended it, no token refused
    with strict_compile_engine(
        model=tiny_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=16,
        num_gpu_blocks_override=10, seed=0,
    ) as plain:  # fmt: skip
        expected = plain.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [list(o.outputs[0].token_ids) for o in expected]


def test_seeded_sampling_with_drafts_is_reproducible_alone_or_in_a_batch(llm):
    prompts = _prompts(seed=2)
    params = SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True
    )
    before = _stats(llm)
    batch = _generate(llm, prompts, params)
    alone = _generate(llm, prompts[1:2], params)
    assert alone[0] == batch[1]
    assert all(len(tokens) == NEW_TOKENS for tokens in batch)
    after = _stats(llm)
    assert after["accepted_tokens"] > before["accepted_tokens"]
    assert after["compiles_after_warmup"] == 0


# `make test-full`: a second engine of its own; n-gram drafts are verified at TP=4 across two hosts
# against one device's greedy tokens in make test (tests/plugin_shim/test_multihost.py), the LM
# head split over the vocabulary as here.
@pytest.mark.full
def test_tensor_parallel_engine_verifies_drafts_to_the_same_greedy_tokens(tiny_dir, hf, tmp_path):
    # Two simulated devices, in a process of their own: the verification program's LM head is
    # split over the vocabulary like the forward's.
    prompts = _prompts(seed=4, count=3)
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(
        json.dumps(
            {"model": tiny_dir, "prompts": prompts, "new_tokens": 24, "speculative_config": SPECULATIVE}
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.spec_decode_tp_engine", str(job), str(out)],
        env={**environment(), "VLLM_XLA_STRICT_COMPILE": "1"}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["tokens"] == [hf_greedy(hf, p, 24) for p in prompts]
    assert result["stats"]["accepted_tokens"] > 0
    assert result["stats"]["compiles_after_warmup"] == 0


@pytest.mark.full  # an engine of its own; tests/tpu_platform/test_speculation.py checks the proposer
def test_a_per_batch_size_schedule_sets_the_drafts_of_each_step(tiny_dir, hf):
    # vLLM's schedule: k=3 for one request, 1 for two, none from three up. Its own engine (the
    # shared one's batches must be drafted k at a time); prompts of one length that fit the pages
    # at once, so a batch stays together from its first step to its last.
    schedule = [(1, 1, 3), (2, 2, 1), (3, 4, 0)]
    speculative = {**SPECULATIVE, "num_speculative_tokens_per_batch_size": schedule}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1, *span, *span, *span[:2]] for span in ([7, 8, 9, 10], [20, 21, 22, 23], [40, 41, 42, 43])]
    with strict_compile_engine(
        model=tiny_dir, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
        seed=0, speculative_config=speculative, disable_log_stats=False,
    ) as engine:  # fmt: skip
        three = _generate(engine, prompts, greedy)
        after_three = _by_position(engine)
        two = _generate(engine, prompts[:2], greedy)
        after_two = _by_position(engine)
        one = _generate(engine, prompts[:1], greedy)
        after_one = _by_position(engine)
        stats = _stats(engine)
    assert three == [hf_greedy(hf, p, 12) for p in prompts]
    assert two == three[:2] and one == three[:1]
    assert after_three == (0, [0, 0, 0])  # three requests: no drafts
    drafted, kept = after_two[0], np.subtract(after_two[1], after_three[1])
    assert drafted > 0 and kept[0] > 0 and kept[1:].sum() == 0  # two: one draft a step, verified
    assert np.subtract(after_one[1], after_two[1])[1:].sum() > 0  # one: drafts past the first kept
    assert stats["compiles_after_warmup"] == 0


def _by_position(llm):
    """vLLM's draft tokens so far and its accepted tokens at each draft position."""
    metrics = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")}
    by_position = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value if metrics else 0
    return drafted, list(by_position.values) if by_position is not None else [0, 0, 0]
