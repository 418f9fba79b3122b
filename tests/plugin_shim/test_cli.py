# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla generate`: a one-shot run with the engine in the same process."""

import dataclasses
import os
import subprocess
import sys
import time

import psutil
import pytest

from pallas_kernels import cpu
from plugin_shim.cli import one_shot_kv_pages, start_detached, step_token_budget
from tests.tiny_models import save_tiny_llama
from tpu_platform.envs import read_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _listing(path):
    return set(os.listdir(path)) if os.path.isdir(path) else set()


def _private_cache_dir(path) -> str:
    shared = os.environ["VLLM_XLA_CACHE_DIR"]
    os.makedirs(path)
    for name in _listing(shared) - {"metrics", "weights"}:
        os.symlink(os.path.join(shared, name), os.path.join(path, name))
    return str(path)


@pytest.mark.slow
def test_generate_prints_the_completion_in_one_process(tmp_path, native_kernels):
    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=2)
    # A cache directory of its own, so another worker's engine cannot write a metrics file beside
    # it; the native kernels and compiled programs are the shared ones.
    cache_dir = _private_cache_dir(tmp_path / "cache")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # the CLI's default
    env["VLLM_XLA_CACHE_DIR"] = cache_dir
    metrics, weights = (os.path.join(cache_dir, name) for name in ("metrics", "weights"))
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
    # A KV cache for its sequences only: 2 of 128 tokens, one 128-token page each, plus vLLM's
    # null page (not the 0.25 GiB budget: 1M tokens of this model).
    assert "CPU KV cache size: 384 tokens" in logs
    assert len(_listing(weights)) == 1  # load_format="npcache": weights kept
    assert _listing(metrics) == set()  # the worker's metrics file is gone


def test_one_shot_kv_pages_hold_the_sequences_within_the_budget(tmp_path):
    model_dir = save_tiny_llama(str(tmp_path / "model"))  # 2 layers, 2 kv heads of 16: 256 B a token in bf16
    cpu_env = dataclasses.replace(read_env(), platform="cpu", cpu_kv_cache_gb=1.0)
    assert one_shot_kv_pages(model_dir, "bfloat16", 2, 2048, cpu_env) == 2 * 16 + 1
    assert one_shot_kv_pages(model_dir, "bfloat16", 16, 300, cpu_env) == 16 * 3 + 1
    # 1 MiB holds 32 pages of 128 tokens in bfloat16, 16 in float32 (and "auto" counts as float32).
    small = dataclasses.replace(cpu_env, cpu_kv_cache_gb=1 / 1024)
    assert one_shot_kv_pages(model_dir, "bfloat16", 16, 2048, small) == 32
    assert one_shot_kv_pages(model_dir, "auto", 16, 2048, small) == 16
    # Elsewhere, or for a model that is not a directory, the budget stands.
    tpu_env = dataclasses.replace(cpu_env, platform="tpu")
    assert one_shot_kv_pages(model_dir, "bfloat16", 2, 2048, tpu_env) is None
    assert one_shot_kv_pages("org/hub-model", "bfloat16", 2, 2048, cpu_env) is None
    # Sliding-window layers beside full ones: vLLM's page groups add up, so the budget stands.
    hybrid = save_tiny_llama(
        str(tmp_path / "hybrid"), sliding_window=64, layer_types=["sliding_attention", "full_attention"]
    )
    assert one_shot_kv_pages(hybrid, "bfloat16", 2, 2048, cpu_env) is None
    every_layer_slides = save_tiny_llama(str(tmp_path / "slides"), sliding_window=64)
    assert one_shot_kv_pages(every_layer_slides, "bfloat16", 2, 2048, cpu_env) == 2 * 16 + 1


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


@pytest.mark.parametrize(
    ("argv", "load_format"),
    [([], ["--load-format", "npcache"]), (["--load-format", "auto"], []), (["--load-format=auto"], [])],
)
def test_serve_keeps_the_embedded_models_weights_prepared_unless_told(monkeypatch, argv, load_format):
    from plugin_shim import cli

    monkeypatch.setenv("VLLM_XLA_PLATFORM", "cpu")
    monkeypatch.setenv("VLLM_XLA_ATTENTION_BACKEND", "xla")  # no native build to start
    monkeypatch.setattr(cli, "_default_model", lambda: "/embedded")
    started = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: started.append(argv))
    cli.main(["serve", *argv])
    assert started[0][3:] == ["--model", "/embedded", *load_format, *argv]


@pytest.mark.parametrize("argv", [[], ["--dtype", "float32"], ["--dtype=float16"]])
def test_serve_picks_generates_dtype_unless_told(monkeypatch, tmp_path, native_kernels, argv):
    """Without `--dtype`, `serve` runs bfloat16 where the native dense kernel runs (vLLM's own
    auto keeps a float32 checkpoint such as the embedded model's in float32 on CPU), as `generate`
    does; a given dtype passes through alone."""
    from plugin_shim import cli

    monkeypatch.setenv("VLLM_XLA_PLATFORM", "cpu")
    monkeypatch.setenv("VLLM_XLA_ATTENTION_BACKEND", "cpu_native")
    started, detached = [], []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: started.append(argv))
    monkeypatch.setattr(cli, "start_detached", detached.append)
    cli.main(["serve", "--model", str(tmp_path), *argv])
    native = cpu.dense_isa(native_kernels) is not None
    chosen = ["--dtype", "bfloat16"] if native and not argv else []
    assert started[0][3:] == ["--model", str(tmp_path), *chosen, *argv]
    assert len(detached) == (1 if argv else 0)  # given a dtype, the build runs beside the server


def test_the_serve_commands_native_build_is_no_child_of_the_server(tmp_path):
    """The server `serve` execs into never waits for a child it did not start: the build must
    not be one (it would stay a zombie once done)."""
    marker = tmp_path / "done"
    code = f"import time; time.sleep(1); open({str(marker)!r}, 'w').close()"
    start_detached([sys.executable, "-c", code])
    children = psutil.Process().children(recursive=True)
    assert not [c for c in children if str(marker) in " ".join(c.cmdline())]  # running, not ours
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()  # and it ran
