# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism across data-parallel replicas through vLLM's OpenAI server:
`--data-parallel-size 2 --enable-expert-parallel` on a tiny Qwen3-MoE, each replica its own
engine process with one simulated CPU device, the two processes one JAX job whose step program
runs both replicas' steps, the experts split by index over the two devices
(`tpu_platform.replica_step`). Concurrent requests answer with transformers' greedy tokens and
are spread over both replicas, and a request alone (its replica busy, the other taking its part
in each step by vLLM's dummy batches) too; prompt logprobs (a program beside the step, on the
replica's device) are transformers'; each replica's log says it holds half of the experts; and
killing one rank's process ends the other's and the server."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import torch

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import save_tiny
from tests.plugin_shim.served import get, post, serving
from tests.plugin_shim.test_data_parallel import (
    NEW_TOKENS,
    PROMPTS,
    _completion_ids,
    _environment,
    _requests_per_engine,
)

pytestmark = pytest.mark.slow  # one server of two engine processes joined in one JAX job


def test_two_replicas_with_the_experts_split_over_them_answer_with_transformers_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    model = save_tiny("Qwen3MoeForCausalLM", str(tmp_path / "model"), seed=7)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    log = tmp_path / "server.log"
    with serving(_two_replicas(model, 1), _environment(1), log, startup_seconds=600) as base:
        got, alone, prompt_logprobs, metrics = _asked(base, model)
        ranks = {
            int(rank): int(pid)
            for rank, pid in re.findall(r"\(EngineCore_DP(\d) pid=(\d+)\)", log.read_text())
        }
        # A rank that dies ends the other and the server (vLLM's watch of its engine processes).
        os.kill(ranks[1], signal.SIGKILL)
        deadline = time.time() + 120
        while psutil.pid_exists(ranks[0]) and time.time() < deadline:
            time.sleep(1)
        assert not psutil.pid_exists(ranks[0]), "rank 0 outlived rank 1 by 120 s"
        with pytest.raises(OSError):
            get(f"{base}/health", timeout=5)
    assert got == want
    assert alone == want[0]
    np.testing.assert_allclose(prompt_logprobs, _hf_prompt_logprobs(hf, PROMPTS[1]), rtol=1e-4, atol=1e-4)
    served = _requests_per_engine(metrics)
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    text = log.read_text()
    assert text.count("experts by index over 2 data-parallel replicas") == 2, text[-3000:]


def _two_replicas(model: str, devices: int) -> list[str]:
    """A small server of 2 replicas of `devices` devices each, the experts split over all."""
    return [
        "--model", model, "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--data-parallel-size", "2",
        "--tensor-parallel-size", str(devices), "--enable-expert-parallel",
    ]  # fmt: skip


def _asked(base: str, model: str) -> tuple[list[list[int]], list[int], list[float], str]:
    """The server's answers: every prompt at once, the first alone (one replica busy, the other
    idle: its dummy steps), the second's prompt logprobs (a program beside the step, on the
    replica's own devices), and its metrics."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _completion_ids(base, model, p), PROMPTS))
    alone = _completion_ids(base, model, PROMPTS[0])
    prompt_logprobs = _prompt_logprobs(base, model, PROMPTS[1])
    return got, alone, prompt_logprobs, get(f"{base}/metrics", timeout=30).decode()


def _prompt_logprobs(base: str, model: str, prompt: list[int]) -> list[float]:
    """The served logprob of each prompt token after the first, given the tokens before it."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    entries = post(f"{base}/v1/completions", body)["choices"][0]["prompt_logprobs"]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], prompt[1:], strict=True)]


def _hf_prompt_logprobs(hf, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i, token]) for i, token in enumerate(prompt[1:])]


@pytest.mark.parametrize(
    "architecture",
    ["Qwen3MoeForCausalLM", pytest.param("GptOssForCausalLM", marks=pytest.mark.full)],  # sinks, biases
    ids=["qwen3_moe", "gpt_oss"],
)
def test_two_replicas_of_two_devices_each_with_the_experts_over_all_four_answer_with_transformers_tokens(
    tmp_path, architecture
):
    """DP 2 x TP 2 (vLLM's expert-parallel group of 4 devices): each replica's engine process
    attends tensor-parallel over its own 2 simulated devices, the experts split over all 4."""
    from transformers import AutoModelForCausalLM

    model = save_tiny(architecture, str(tmp_path / "model"), seed=7)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    log = tmp_path / "server.log"
    with serving(_two_replicas(model, 2), _environment(2), log, startup_seconds=600) as base:
        got, alone, prompt_logprobs, metrics = _asked(base, model)
    assert got == want
    assert alone == want[0]
    np.testing.assert_allclose(prompt_logprobs, _hf_prompt_logprobs(hf, PROMPTS[1]), rtol=1e-4, atol=1e-4)
    served = _requests_per_engine(metrics)
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    after_warm_up = [
        line for line in metrics.splitlines() if line.startswith("vllm_xla:compilations_after_warmup")
    ]
    assert len(after_warm_up) == 2 and all(float(line.rsplit(" ", 1)[1]) == 0 for line in after_warm_up), (
        after_warm_up
    )
    said = "experts by index over 2 data-parallel replicas, each x2 tensor parallel, 4 devices"
    assert log.read_text().count(said) == 2, log.read_text()[-3000:]
