# SPDX-License-Identifier: Apache-2.0
"""The peers of `throughput.py`: model directories, workloads, and the offline workers.

Every function here runs inside one worker subprocess (except the model preparation, done once
by the parent). A worker measures one workload on one peer and returns a JSON-able dict:

- `xla`: vLLM on our platform (`VLLM_XLA_PLATFORM=cpu`), reading the embedded GGUF directory.
- `vllm-cpu`: vLLM's built-in CPU backend (`VLLM_TARGET_DEVICE=cpu`), on a safetensors copy.
- `hf`: transformers `generate`, batched with left padding, on the same safetensors copy.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from typing import Any

import numpy as np

HF_COPY_NAME = "SmolLM2-135M-Instruct-hf"
VLLM_LIMITS = dict(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=1024)
FIRST_ID = 100  # random prompt ids start above the special tokens (0..16 in SmolLM2)
SEED = 0
OURS = ("xla", "xla-int8", "xla-bf16")  # the peers that run vLLM on vllm-xla


def quantization_of(peer: str) -> str | None:
    """vLLM's `quantization` for `peer`: int8 weights quantized at load for our int8 peer."""
    return "int8_per_channel_weight_only" if peer == "xla-int8" else None


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of every workload (full run or `--quick`)."""

    batch_prompts: int
    batch_prompt_len: tuple[int, int]
    batch_output: int
    single_prompt_len: int
    single_output: int
    single_repeats: int
    warmup_prompt_len: int
    warmup_output: int
    serve_requests: int
    serve_concurrency: int
    serve_prompt_len: tuple[int, int]
    serve_output: int

    @classmethod
    def full(cls) -> Sizes:
        return cls(64, (32, 256), 128, 32, 128, 3, 16, 8, 64, 16, (32, 256), 64)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(16, (32, 256), 32, 32, 32, 2, 16, 8, 16, 4, (32, 128), 32)


def random_prompts(n: int, lengths: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """`n` prompts of uniformly random length in [lo, hi] made of random vocabulary ids."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=n)
    return [rng.integers(FIRST_ID, vocab_size, size=int(s)).tolist() for s in sizes]


# ---------------------------------------------------------------------------------------------
# Model directories


def cache_dir() -> str:
    from tpu_platform.envs import read_env

    return read_env().cache_dir


def gguf_model_dir() -> str:
    """The embedded model as our platform reads it (config, tokenizer, link to the GGUF)."""
    from plugin_shim.model_dir import materialize

    return materialize(cache_dir())


def hf_model_dir_ready() -> bool:
    return os.path.exists(os.path.join(cache_dir(), "models", HF_COPY_NAME, ".complete"))


def hf_model_dir(gguf_dir: str) -> str:
    """A float32 safetensors copy of the embedded model, for vLLM's CPU backend and transformers."""
    target = os.path.join(cache_dir(), "models", HF_COPY_NAME)
    marker = os.path.join(target, ".complete")
    if os.path.exists(marker):
        return target
    import torch
    from transformers import AutoModelForCausalLM

    from plugin_shim.model_dir import embedded_gguf_path

    gguf = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    # The GGUF weights are already dequantized to dense tensors: drop the GGUF "quantizer" so
    # save_pretrained writes plain safetensors and config.json claims no quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_model_dir(model, target, gguf_dir)


def save_model_dir(model, target: str, tokenizer_dir: str) -> str:
    """Writes transformers `model` as float32 safetensors, with `tokenizer_dir`'s tokenizer files,
    to `target`: staged beside it and moved in whole, then marked complete (`.complete`)."""
    staging = target + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(tokenizer_dir, name), staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    open(os.path.join(target, ".complete"), "w").close()
    return target


def vocab_size(model_dir: str) -> int:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


# ---------------------------------------------------------------------------------------------
# vLLM peers (in-process engine)


def _llm(model_dir: str, dtype: str, kv_cache_dtype: str = "auto", quantization: str | None = None):
    from vllm import LLM

    return LLM(
        model=model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization, seed=SEED,
        **VLLM_LIMITS,
    )  # fmt: skip


def _platform_info(peer: str) -> dict[str, Any]:
    from vllm.platforms import current_platform

    if peer in OURS:
        from plugin_shim.active import assert_active

        assert_active()
    elif current_platform.is_out_of_tree():
        raise RuntimeError(
            f"vllm-cpu peer runs on {type(current_platform).__name__}, an out-of-tree platform"
        )
    return {
        "platform": type(current_platform).__name__,
        "engine_mode": "in-process"
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        else "engine-core subprocess",
    }


def _greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _vllm_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds and output lengths of one `generate` call over token-id prompts."""
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, _greedy(max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [len(o.outputs[0].token_ids) for o in outputs]


def _runner_stats(llm, peer: str) -> dict[str, Any] | None:
    return llm.collective_rpc("runner_stats")[0] if peer in OURS else None


def run_vllm(
    peer: str, workload: str, model_dir: str, dtype: str, sizes: Sizes, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    """`batch` or `single` on one vLLM peer; start-up, warm-up and the timed run reported apart."""
    start = time.perf_counter()
    quantization = quantization_of(peer)
    llm = _llm(model_dir, dtype, kv_cache_dtype, quantization)
    result: dict[str, Any] = {
        "startup_seconds": time.perf_counter() - start,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "quantization": quantization,
    }
    result.update(_platform_info(peer), limits=VLLM_LIMITS)
    result["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    result["runner_stats_after_startup"] = _runner_stats(llm, peer)
    vocab = vocab_size(model_dir)
    warm = random_prompts(1, (sizes.warmup_prompt_len,) * 2, vocab, SEED + 1)
    result["warmup_seconds"], _ = _vllm_generate(llm, warm, sizes.warmup_output)
    if workload == "batch":
        result.update(_measure_batch(lambda p, n: _vllm_generate(llm, p, n), vocab, sizes))
    else:
        result.update(_measure_single(lambda p, n: _vllm_generate(llm, p, n), vocab, sizes))
    result["runner_stats"] = _runner_stats(llm, peer)
    return result


# ---------------------------------------------------------------------------------------------
# Shared measurements (a `generate(prompts, max_tokens) -> (seconds, output lengths)` callable)


def _measure_batch(generate, vocab: int, sizes: Sizes) -> dict[str, Any]:
    prompts = random_prompts(sizes.batch_prompts, sizes.batch_prompt_len, vocab, SEED)
    seconds, lengths = generate(prompts, sizes.batch_output)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(lengths)
    return {
        "prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sizes.batch_output * len(prompts),
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (prompt_tokens + output_tokens) / seconds,
    }


def _measure_single(generate, vocab: int, sizes: Sizes) -> dict[str, Any]:
    """`single_repeats` 1-token requests (the first token: their median, since one short request
    is easily moved by a time slice lost to another job), then as many timed streams; each
    prompt is new (no prefix-cache hit)."""
    repeats = sizes.single_repeats
    prompts = random_prompts(2 * repeats, (sizes.single_prompt_len,) * 2, vocab, SEED + 2)
    first_tokens = [generate([prompt], 1)[0] for prompt in prompts[:repeats]]
    ttft = statistics.median(first_tokens)
    runs = [generate([prompt], sizes.single_output) for prompt in prompts[repeats:]]
    seconds = statistics.median(s for s, _ in runs)
    tokens = runs[0][1][0]
    decode = (seconds - ttft) / max(tokens - 1, 1)
    return {
        "prompt_tokens": sizes.single_prompt_len,
        "output_tokens": tokens,
        "expected_output_tokens": sizes.single_output,
        "seconds": seconds,
        "run_seconds": [s for s, _ in runs],
        "tok_s": tokens / seconds,
        "first_token_seconds": ttft,
        "first_token_run_seconds": first_tokens,
        "decode_tok_s": 1.0 / decode if decode > 0 else None,
    }


# ---------------------------------------------------------------------------------------------
# transformers peer


def _hf_generate(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> tuple[float, list[int]]:
    """Seconds and output lengths of one batched, left-padded greedy `generate`."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, pad_token_id=pad_id,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    return seconds, [int(out.shape[1] - width)] * len(prompts)


def run_hf(workload: str, model_dir: str, dtype: str, sizes: Sizes) -> dict[str, Any]:
    """`batch` or `single` with transformers `generate` (one batch, left padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    result: dict[str, Any] = {"startup_seconds": time.perf_counter() - start, "dtype": dtype}
    result["torch_threads"] = torch.get_num_threads()
    pad_id = model.generation_config.pad_token_id
    pad_id = 2 if pad_id is None else int(pad_id)

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        return _hf_generate(model, prompts, max_tokens, pad_id)

    vocab = vocab_size(model_dir)
    warm = random_prompts(1, (sizes.warmup_prompt_len,) * 2, vocab, SEED + 1)
    result["warmup_seconds"], _ = generate(warm, sizes.warmup_output)
    measure = _measure_batch if workload == "batch" else _measure_single
    result.update(measure(generate, vocab, sizes))
    return result
