# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 and EAGLE-1 speculative decoding through vLLM's real engine: vLLM reads the head's config
(`LlamaForCausalLMEagle3`; a one-layer Llama config, vLLM's `EagleLlamaForCausalLM`) and schedules
its drafts; greedy output equals transformers' greedy decoding token for token (so equals
decoding without speculation), for prompts prefilled at once and in chunks, under preemption;
the head drafts for every request (a random head: its drafts are rarely kept) and vLLM's
spec-decode counters agree with ours; nothing compiles after warm-up. Each head has its own
embedding here (the EAGLE-1 head its own LM head too; `tests/tpu_platform/test_eagle.py` and
`test_eagle3.py` share the target's and check the drafts against torch references)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.greedy_reference import hf_greedy
from tests.plugin_shim.tensor_parallel_engine import environment
from tests.speculation_engine import greedy_run_equals_reference, strict_compile_engine
from tests.tiny_models import save_tiny_eagle3_head, save_tiny_eagle_head, save_tiny_llama

pytestmark = pytest.mark.slow  # builds vllm.LLM

NEW_TOKENS = 24
K = 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = save_tiny_llama(str(tmp_path_factory.mktemp("eagle3_target")), seed=11, num_hidden_layers=4)
    head = save_tiny_eagle3_head(
        str(tmp_path_factory.mktemp("eagle3_head")), target, seed=12, aux_layer_ids=(1, 2, 4),
        draft_vocab_size=320, own_embedding=True,
    )  # fmt: skip
    return target, head


@pytest.fixture(scope="module", params=["eagle3", "eagle"])
def method(request):
    return request.param


@pytest.fixture(scope="module")
def llm(dirs, method, tmp_path_factory):
    target, head = dirs
    if method == "eagle":
        head = save_tiny_eagle_head(
            str(tmp_path_factory.mktemp("eagle_head")), target, seed=12, own_embedding=True, own_lm_head=True
        )
    # A 16-token step budget chunks every prompt; 12 pages of 16 tokens cannot hold four
    # sequences of ~50 tokens (and their lookahead slots) at once: the scheduler preempts.
    with strict_compile_engine(
        model=target, tokenizer=target, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
        block_size=16, seed=0, disable_log_stats=False, num_gpu_blocks_override=12,
        speculative_config={"method": method, "model": head, "num_speculative_tokens": K},
    ) as engine:  # fmt: skip
        yield engine


def test_greedy_with_a_head_equals_greedy_decoding(llm, dirs):
    hf = LlamaForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    # Prompts within the 16-token step budget prefill at once, the others in chunks.
    stats = greedy_run_equals_reference(llm, hf, NEW_TOKENS, lengths=(9, 15, 26, 31))
    assert stats["draft_tokens"] >= 4 * K  # every request drafted
    assert stats["preempted_requests"] > 0


@pytest.mark.full  # an engine at TP=2 in a subprocess: minutes on 2 cores (the runner-level test: make test)
def test_tensor_parallel_engine_with_an_eagle3_head_gives_the_same_greedy_tokens(dirs, tmp_path):
    # Two simulated devices, in a process of their own: the head split as the target is, its
    # cache on the KV heads (`tests/tpu_platform/test_speculation_tensor_parallel.py` checks
    # its drafts and placement at the runner).
    hf = LlamaForCausalLM.from_pretrained(dirs[0], dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    prompts = [[1, *rng.integers(3, 384, n - 1).tolist()] for n in (9, 26)]
    speculative = {"method": "eagle3", "model": dirs[1], "num_speculative_tokens": K}
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(
        json.dumps(
            {"model": dirs[0], "prompts": prompts, "new_tokens": 12, "speculative_config": speculative}
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.spec_decode_tp_engine", str(job), str(out)],
        env={**environment(), "VLLM_XLA_STRICT_COMPILE": "1"}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["tokens"] == [hf_greedy(hf, p, 12) for p in prompts]
    assert result["stats"]["draft_tokens"] >= len(prompts) * K  # every request drafted
    assert result["stats"]["verified_steps"] > 0
    assert result["stats"]["compiles_after_warmup"] == 0
