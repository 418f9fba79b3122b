# SPDX-License-Identifier: Apache-2.0
"""vLLM's real engine on the XLA platform, against transformers greedy decoding."""

import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from plugin_shim.active import assert_active
from tests.greedy_reference import hf_greedy
from tests.tiny_models import save_tiny_llama

NEW_TOKENS = 12
KV_CACHE_BYTES = 4 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("engine_llama")), seed=1)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


# The fast tier's one engine start through vLLM: the two unmarked tests below (the engine's start,
# our platform active, one greedy prompt against transformers); the rest of the file is `slow`.
@pytest.fixture(scope="module")
def llm(tiny_dir):
    # 16-token pages (the CPU's default is 128): sequences span several pages, and a 50-token
    # prompt fills whole pages the prefix cache can share. vLLM's `kv_cache_memory_bytes` sizes
    # the cache (`test_kv_cache_takes_vllms_kv_cache_memory_bytes`).
    engine = LLM(
        model=tiny_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, block_size=16, seed=0,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()


@pytest.mark.slow
def test_kv_cache_takes_vllms_kv_cache_memory_bytes(llm):
    # A 16-token page of 2 layers, 2 kv heads of 16, float32: 8 KiB; 4 MiB hold 512 of them (the
    # VLLM_XLA_CPU_KV_CACHE_GB budget of the tests, 0.25 GiB, would hold 32768).
    assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == KV_CACHE_BYTES // (8 << 10)


def _prompts(lengths, seed=0, vocab=384):
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, vocab, n - 1).tolist()] for n in lengths]


def _greedy(max_tokens=NEW_TOKENS, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_plugin_is_the_active_platform(llm):
    assert_active()
    from vllm.platforms import current_platform

    assert current_platform.is_out_of_tree()


def test_single_prompt_matches_transformers(llm, hf):
    (prompt,) = _prompts([7])
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], _greedy())
    assert _token_ids(out) == [hf_greedy(hf, prompt, NEW_TOKENS)]


@pytest.mark.slow
def test_batch_of_mixed_lengths_matches_transformers(llm, hf):
    prompts = _prompts([3, 17, 16, 40, 61], seed=2)
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _greedy())
    assert _token_ids(out) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.slow
def test_greedy_steps_take_the_forwards_argmax_and_others_run_the_sampler(llm, hf):
    def counters():
        stats = llm.collective_rpc("runner_stats")[0]
        return stats["steps"], stats["sampler_steps"]

    prompts = _prompts([9, 23], seed=5)
    steps, sampler_steps = counters()
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _greedy())
    assert _token_ids(out) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    greedy_steps, after_greedy = counters()
    assert greedy_steps > steps and after_greedy == sampler_steps
    # A penalty changes the logits before the argmax: the sampler program runs every step.
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], _greedy(repetition_penalty=1.5))
    penalty_steps, after_penalty = counters()
    assert after_penalty - after_greedy == penalty_steps - greedy_steps > 0


@pytest.mark.slow
def test_warm_up_builds_no_sampler_program_for_argmax_only_steps(llm):
    # No logits processor is installed: argmax-only steps never run a sampler program.
    keys = llm.collective_rpc(lambda worker: worker.runner.programs.keys())[0]
    samplers = [key for key in keys if key[0] == "sample"]
    assert samplers and not any(key[2].argmax_only for key in samplers)
    assert any(key[2].all_greedy for key in samplers)  # greedy with extras still is


@pytest.mark.slow
def test_prefix_cache_hit_gives_the_same_tokens(llm, hf):
    (prompt,) = _prompts([50], seed=3)
    expected = hf_greedy(hf, prompt, NEW_TOKENS)
    first = llm.generate([TokensPrompt(prompt_token_ids=prompt)], _greedy())
    second = llm.generate([TokensPrompt(prompt_token_ids=prompt)], _greedy())
    assert second[0].num_cached_tokens >= 32
    assert _token_ids(first) == _token_ids(second) == [expected]


@pytest.mark.slow
def test_text_prompt_max_tokens_and_stop_string(llm, hf):
    out = llm.generate(["hello world"], _greedy(max_tokens=10))[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    text = out.outputs[0].text
    stop = text[3:6]
    assert stop, text
    stopped = llm.generate(["hello world"], _greedy(max_tokens=10, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert text.startswith(stopped.text)


@pytest.mark.slow
def test_n_samples_are_reproducible_with_a_seed(llm):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    first = llm.generate(["hello"], params)[0].outputs
    second = llm.generate(["hello"], params)[0].outputs
    assert len(first) == 2 and all(len(c.token_ids) == 8 for c in first)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]


@pytest.mark.slow
def test_prompt_embeds_are_refused_and_the_engine_keeps_serving(llm, hf, tiny_dir):
    # The worker runs token ids only: an embeddings prompt once came out as wrong text. The
    # option is refused at start, and vLLM refuses such a prompt to an engine without it.
    with pytest.raises(ValueError, match=r"enable_prompt_embeds \(.*not supported by vllm-xla"):
        LLM(model=tiny_dir, max_model_len=128, enable_prompt_embeds=True)
    (prompt,) = _prompts([6], seed=6)
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(prompt))
    with pytest.raises(ValueError, match="enable-prompt-embeds"):
        llm.generate([{"prompt_embeds": embeds}], _greedy())
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], _greedy())
    assert _token_ids(out) == [hf_greedy(hf, prompt, NEW_TOKENS)]


@pytest.mark.parametrize(("keep", "expected"), [("0", False), ("1", True)])
def test_vllm_config_on_the_cpu_device_schedules_in_step(tiny_dir, monkeypatch, keep, expected):
    # vLLM resolves its default (async on) and then lets the platform hook have the last word.
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_XLA_CPU_ASYNC_SCHEDULING", keep)
    config = EngineArgs(model=tiny_dir, max_model_len=128).create_engine_config()
    assert config.scheduler_config.async_scheduling is expected


def test_enforce_eager_with_strict_compile_is_refused_by_name(tiny_dir, monkeypatch):
    # Strict compile makes a compile after warm-up an error, and enforce_eager has no warm-up.
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_XLA_STRICT_COMPILE", "1")
    EngineArgs(model=tiny_dir, max_model_len=128).create_engine_config()
    with pytest.raises(ValueError, match=r"enforce_eager skips warm-up.*VLLM_XLA_STRICT_COMPILE=1"):
        EngineArgs(model=tiny_dir, max_model_len=128, enforce_eager=True).create_engine_config()


@pytest.mark.parametrize(("block_size", "expected"), [(None, 128), (16, 16)])
def test_pages_on_the_cpu_device_hold_128_tokens_unless_given(tiny_dir, block_size, expected):
    # vLLM's own CPU backend's default; decode attention reads longer runs of a page.
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=tiny_dir, max_model_len=128, block_size=block_size).create_engine_config()
    assert config.cache_config.block_size == expected


@pytest.mark.slow
@pytest.mark.parametrize(("async_scheduling", "enforce_eager"), [(True, False), (False, True)])
def test_chunked_prefill_and_preemption_match_transformers(tiny_dir, hf, async_scheduling, enforce_eager):
    # A tiny step budget forces chunked prefill; 10 pages of 16 tokens cannot hold the four
    # 48-token sequences at once, so the scheduler must preempt and recompute. With async
    # scheduling (vLLM's default) every step is dispatched before the previous one's tokens
    # reach the host, across chunk boundaries, preemptions and resumptions. The in-step engine
    # also skips warm-up (`enforce_eager`): its programs compile as its steps first need them.
    small = LLM(
        model=tiny_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
        block_size=16, num_gpu_blocks_override=10, seed=0, async_scheduling=async_scheduling,
        enforce_eager=enforce_eager,
    )  # fmt: skip
    built_at_start = small.collective_rpc("runner_stats")[0]["compiles"]
    prompts = _prompts([40, 37, 45, 42], seed=4)
    out = small.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _greedy(max_tokens=24))
    stats = small.collective_rpc("runner_stats")[0]
    again = small.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], _greedy(max_tokens=24))
    built_again = small.collective_rpc("runner_stats")[0]["compiles"] - stats["compiles"]
    del small
    gc.collect()
    assert _token_ids(out) == _token_ids(again) == [hf_greedy(hf, p, 24) for p in prompts]
    # Warm-up builds every program before serving; without it the first run builds what it
    # needs, and the same workload again builds nothing new either way.
    if enforce_eager:
        assert built_at_start == 0 < stats["compiles"]
    else:
        assert built_at_start == stats["compiles"]
    assert built_again == 0 and stats["compiles_after_warmup"] == 0
    assert stats["partial_prefill_steps"] > 0
    assert stats["preempted_requests"] > 0 and stats["resumed_requests"] > 0
    # Decode steps take the previous step's tokens on the device only under async scheduling.
    assert stats["fed_steps"] > 24 if async_scheduling else stats["fed_steps"] == 0
    assert async_scheduling or stats["overlapped_steps"] == 0
    # The runtime's part of the host time: one forward dispatch a step at least, inside it.
    assert 0 < stats["dispatch_seconds"] < stats["host_seconds"]
