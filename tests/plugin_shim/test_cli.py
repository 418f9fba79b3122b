# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla generate`: a one-shot run with the engine in the same process."""

import os
import subprocess
import sys

import pytest

from pallas_kernels import cpu
from plugin_shim.cli import step_token_budget
from tests.tiny_models import save_tiny_llama

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_prints_the_completion_in_one_process(tmp_path, native_kernels):
    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=2)
    env = {
        k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"
    }  # the CLI's own default
    cli = os.path.join(os.path.dirname(sys.executable), "vllm-xla")
    done = subprocess.run(
        [cli, "generate", "hello world", "--model", model_dir, "--max-tokens", "4", "--max-model-len", "128",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "16"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("hello world")
    logs = done.stdout + done.stderr
    assert "warm-up built" in logs
    assert "(EngineCore" not in logs  # no engine-core subprocess was started
    # dtype auto: bfloat16 on the native dense kernel where the CPU has it, else float32.
    dtype = "bfloat16" if cpu.dense_isa(native_kernels) else "float32"
    assert f"loaded LlamaForCausalLM ({dtype})" in logs


def test_step_token_budget_is_the_power_of_two_holding_the_longest_prompt():
    assert step_token_budget(["The capital of France is"], 1) == 32  # 24 bytes + 8
    assert step_token_budget(["hi", "x" * 100], 2) == 128
    assert step_token_budget(["é" * 30], 1) == 128  # 60 bytes of UTF-8, not 30 characters
    assert step_token_budget(["x" * 5000], 1) == 512  # longer prompts are prefilled in chunks
    assert step_token_budget(["x" * 5000], 1, most=1024) == 1024
    assert step_token_budget(["a"], 1) == 16  # the smallest budget
    assert step_token_budget(["a"] * 64, 64) == 64  # never fewer tokens than sequences per step
    assert step_token_budget(["a"] * 600, 600) == 600


PROMPTS = [
    "The capital of France is",
    "😀" * 10,  # 40 bytes: a token per byte in a BPE that never saw them
    "   spaces   and\ttabs\n\n",
    "ünïcödé 日本語 😀😀",
    "a" * 300,
    "!?" * 50,
]


def test_step_token_budget_bounds_real_tokenizers(tmp_path):
    """Every prompt fits one step of the budget, by the embedded model's tokenizer and a byte-level
    BPE one, special tokens included: `generate` then prefills each prompt in one step."""
    from transformers import AutoTokenizer

    from plugin_shim.model_dir import materialize
    from tpu_platform.envs import read_env

    tiny = save_tiny_llama(str(tmp_path / "model"), seed=0)
    for model_dir in (materialize(read_env().cache_dir), tiny):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for prompt in PROMPTS:
            tokens = len(tokenizer(prompt, add_special_tokens=True)["input_ids"])
            assert 0 < tokens <= step_token_budget([prompt], 1), (model_dir, prompt, tokens)


@pytest.mark.parametrize(("asked", "expected"), [(None, "fork"), ("spawn", "spawn"), ("fork", "fork")])
def test_serve_forks_the_engine_process_unless_told_otherwise(monkeypatch, tmp_path, asked, expected):
    """vLLM's server entry point would spawn its engine process (a second import of vLLM, torch
    and JAX); `vllm-xla serve` asks for a fork (JAX never runs in the front end) unless the user
    chose. The platform still spawns where JAX runs (`test_platform.py`)."""
    from plugin_shim import cli

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", asked or "")  # restored after the test
    if asked is None:
        monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    monkeypatch.setenv("VLLM_XLA_PLATFORM", "cpu")
    monkeypatch.setenv("VLLM_XLA_ATTENTION_BACKEND", "xla")  # no native build to start
    started = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: started.append(argv))
    cli.main(["serve", "--model", str(tmp_path), "--port", "1"])
    assert started[0][1:] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tmp_path),
        "--port",
        "1",
    ]
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == expected
