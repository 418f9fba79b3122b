# SPDX-License-Identifier: Apache-2.0
"""Data parallelism through vLLM's OpenAI server: `--data-parallel-size 2` replicas of a dense
model (vLLM runs them as independent engines) and of an MoE model at TP=2 each (vLLM runs those
in lock step, an idle replica taking dummy steps), every replica its own engine process with its
own simulated CPU devices. Concurrent requests answer with transformers' greedy tokens and are
spread over both replicas (vLLM's per-engine request counters). The dense model's replicas are
`make test-full`'s."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts, save_tiny
from tests.plugin_shim.served import REPO, get, post, serving
from tests.tiny_models import save_tiny_llama
from tests.xla_flags import with_host_devices

pytestmark = pytest.mark.slow  # two servers of two engine processes each

NEW_TOKENS = 5
PROMPTS = prompts([5, 9, 3, 12, 7, 4, 10, 6], seed=11)


def _environment(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env.update(
        XLA_FLAGS=with_host_devices(devices),
        JAX_PLATFORMS="cpu",
        VLLM_XLA_PLATFORM="cpu",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        PYTHONPATH=REPO,
    )
    return env


def _serve_and_check(model_dir: str, tmp_path, tensor_parallel: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    args = [
        "--model", model_dir, "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "32", "--data-parallel-size", "2",
        "--tensor-parallel-size", str(tensor_parallel),
    ]  # fmt: skip
    with serving(args, _environment(tensor_parallel), tmp_path / "server.log", startup_seconds=600) as base:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _completion_ids(base, model_dir, p), PROMPTS))
        metrics = get(f"{base}/metrics", timeout=30).decode()
    assert got == want
    served = _requests_per_engine(metrics)
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    assert sum(served.values()) == len(PROMPTS)


def _completion_ids(base: str, model: str, prompt: list[int]) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return post(f"{base}/v1/completions", body)["choices"][0]["token_ids"]


def _requests_per_engine(metrics: str) -> dict[str, float]:
    """vLLM's finished-request counter of each engine (summed over finish reasons)."""
    served: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            served[engine] = served.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return served


# `make test-full`: the MoE replicas below take every step of our worker's this one takes (each
# replica's own devices, its requests' tokens against transformers), and the idle one's dummy steps.
@pytest.mark.full
def test_two_replicas_of_a_dense_model_answer_with_transformers_tokens(tmp_path):
    model = save_tiny_llama(str(tmp_path / "model"), seed=6)
    _serve_and_check(model, tmp_path, tensor_parallel=1)


def test_two_replicas_of_an_moe_model_at_tp2_answer_with_transformers_tokens(tmp_path):
    model = save_tiny("MixtralForCausalLM", str(tmp_path / "model"), seed=6)
    _serve_and_check(model, tmp_path, tensor_parallel=2)
