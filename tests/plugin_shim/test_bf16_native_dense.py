# SPDX-License-Identifier: Apache-2.0
"""bfloat16 serving on our platform, with the dense layers on the native kernel (AMX, AVX-512
BF16 or AVX2 FMA) where the CPU has one of them: greedy
continuations checked token by token against transformers' float32 logits (teacher forcing)."""

import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from vllm import LLM, SamplingParams

from pallas_kernels import cpu
from plugin_shim.active import assert_active
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # builds vllm.LLM

PROMPTS = ([1, 17, 33, 90, 5], [1, 200, 7], [1, *range(40, 100)])
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(
        str(tmp_path_factory.mktemp("bf16")), seed=2, hidden_size=128, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=256,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm(model_dir):
    limits = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    engine = LLM(model=model_dir, dtype="bfloat16", seed=0, **limits)
    assert_active()
    yield engine
    del engine
    gc.collect()


def test_dense_layers_run_on_the_native_kernel_where_the_cpu_has_it(llm, dense_kernels):
    best = cpu.dense_isa(dense_kernels)
    assert llm.collective_rpc(lambda worker: worker.runner.dense_isa) == [best]


def test_greedy_tokens_are_transformers_argmax_within_bf16_error(llm, model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        generated = list(output.outputs[0].token_ids)
        assert len(generated) == NEW_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1 :].numpy()
        chosen = logits[np.arange(NEW_TOKENS), generated]
        best = logits.max(axis=-1)
        spread = best - logits.min(axis=-1)
        # Each token is float32's argmax or within bfloat16's error of it, never a far-off one.
        assert np.all(best - chosen <= 0.03 * spread), (generated, best - chosen, spread)
        assert np.mean(chosen == best) >= 0.75
