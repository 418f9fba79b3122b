# SPDX-License-Identifier: Apache-2.0
"""vLLM's OpenAI server on our platform for each newer family: GPT-OSS (attention sinks,
alternating sliding and full layers), Llama 4 (chunked and NoPE layers, a shared expert), GLM-4.5,
Gemma 4 (per-layer head dims, KV sharing) and DeepSeek V2 and V3 (latent attention). One server a
family, started in turn on first use; concurrent `/v1/completions` (token and text prompts) and a
`/v1/chat/completions` through the tiny tokenizer's chat template each answer exactly transformers'
fp32 greedy tokens, and no step compiles after warm-up. vLLM renders GPT-OSS chats with its harmony
encoding rather than the tokenizer's template (a vocabulary the tiny tokenizer lacks), so GPT-OSS
is checked on completions only."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts, save_tiny
from tests.models.tiny_deepseek import save_tiny_deepseek
from tests.models.tiny_glm4_moe import save_tiny_glm4_moe
from tests.plugin_shim.served import get, post, serving

# Six servers in turn: `make test-full`. The server path itself is model-agnostic and `make test`
# serves other models through it (test_serve.py and others); every family here goes through
# `vllm.LLM` in `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.full]

NEW_TOKENS = 6
TOKEN_PROMPTS = prompts([5, 13, 9], seed=11)
TEXT_PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "hello world"}]
# A plain role-tagged template: the tiny tokenizers are trained without one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

# family -> (transformers architecture, checkpoint builder); CHATLESS: served without a chat check
CHATLESS = {"gpt_oss"}
FAMILIES = {
    "gpt_oss": ("GptOssForCausalLM", functools.partial(save_tiny, "GptOssForCausalLM")),
    "llama4": ("Llama4ForCausalLM", functools.partial(save_tiny, "Llama4ForCausalLM")),
    "glm4_moe": ("Glm4MoeForCausalLM", functools.partial(save_tiny_glm4_moe, "qk_norm")),
    "gemma4": ("Gemma4ForCausalLM", functools.partial(save_tiny, "Gemma4ForCausalLM")),
    "deepseek_v2": ("DeepseekV2ForCausalLM", functools.partial(save_tiny_deepseek, "v2_lite_greedy")),
    "deepseek_v3": ("DeepseekV3ForCausalLM", functools.partial(save_tiny_deepseek, "v3_noaux_yarn")),
}


def _with_chat_template(path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def _complete(base: str, model: str, prompt: list[int] | str) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return post(f"{base}/v1/completions", body)["choices"][0]


def _chat(base: str, model: str) -> dict:
    body = {
        "model": model,
        "messages": CHAT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return post(f"{base}/v1/chat/completions", body)


def _compilations_after_warmup(base: str) -> float:
    text = get(f"{base}/metrics").decode()
    (line,) = [line for line in text.splitlines() if line.startswith("vllm_xla:compilations_after_warmup")]
    return float(line.rsplit(" ", 1)[1])


def _serve(path: str, log_path, *, chat: bool) -> dict:
    """Starts the server on `path`, sends every request at once, and returns the answers."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    args = [
        "--model", path, "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "16",
    ]  # fmt: skip
    with serving(args, env, log_path, startup_seconds=400) as base:
        with ThreadPoolExecutor(max_workers=len(TOKEN_PROMPTS) + 2) as pool:
            completions = [pool.submit(_complete, base, path, p) for p in [*TOKEN_PROMPTS, TEXT_PROMPT]]
            chatted = pool.submit(_chat, base, path) if chat else None
            answers = {
                "completions": [c.result() for c in completions],
                "chat": chatted.result() if chatted else None,
            }
        answers["compilations_after_warmup"] = _compilations_after_warmup(base)
    return answers


class _Served:
    """Each family's server answers (a server a family, on first use) and its transformers model."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._done: dict[str, tuple] = {}

    def __call__(self, family: str) -> tuple:
        if family not in self._done:
            import torch
            import transformers

            architecture, build = FAMILIES[family]
            tmp = self._tmp.mktemp(family)
            path = build(str(tmp / "model"))
            _with_chat_template(path)
            answers = _serve(path, tmp / "server.log", chat=family not in CHATLESS)
            hf = getattr(transformers, architecture).from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            self._done[family] = (answers, hf.eval(), tokenizer)
        return self._done[family]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> _Served:
    return _Served(tmp_path_factory)


def _text(tokenizer, token_ids: list[int]) -> str:
    """The text vLLM's detokenizer gives for `token_ids`: special tokens skipped, and a trailing
    incomplete UTF-8 sequence held back (random tokens often end mid-character)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_concurrent_completions_are_transformers_greedy_tokens(served, family):
    answers, hf, tokenizer = served(family)
    *by_tokens, by_text = answers["completions"]
    for prompt, choice in zip(TOKEN_PROMPTS, by_tokens, strict=True):
        assert choice["token_ids"] == hf_greedy(hf, prompt, NEW_TOKENS), prompt
        assert choice["text"] == _text(tokenizer, choice["token_ids"])
    text_ids = tokenizer(TEXT_PROMPT)["input_ids"]
    assert by_text["prompt_token_ids"] == text_ids
    assert by_text["token_ids"] == hf_greedy(hf, text_ids, NEW_TOKENS)
    assert answers["compilations_after_warmup"] == 0


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in CHATLESS])
def test_chat_completion_follows_the_template_and_is_greedy(served, family):
    answers, hf, tokenizer = served(family)
    chat = answers["chat"]
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert rendered.startswith("<s>user: hello world\n") and rendered.endswith("assistant:")
    assert chat["prompt_token_ids"] == prompt_ids
    choice = chat["choices"][0]
    assert choice["token_ids"] == hf_greedy(hf, prompt_ids, NEW_TOKENS)
    assert choice["message"]["content"] == _text(tokenizer, choice["token_ids"])
