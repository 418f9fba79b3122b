# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters under tensor parallelism through `vllm.LLM` on simulated CPU devices: at TP=4
(KV heads repeated) and, in `make test-full`, TP=2 (each device its own KV head), one batch of
base rows and two adapters generates transformers' greedy tokens, and logprobs, with each row's
adapter merged; nothing compiles after warm-up (VLLM_XLA_STRICT_COMPILE=1)."""

import numpy as np
import pytest
import torch

from tests.greedy_reference import hf_greedy
from tests.lora_adapters import merged, scaling, write_adapter
from tests.plugin_shim.test_lora_engine import ADAPTERS
from tests.plugin_shim.test_tensor_parallel import _run_engines
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # engines on simulated multi-device hosts

NEW_TOKENS = 5
NAMES = [None, "all", "qv", "all"]
ENGINE = dict(
    dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, seed=0,
    enable_lora=True, max_loras=2, max_lora_rank=8,
)  # fmt: skip


# TP=4 splits the adapters with their projections and repeats the 2 KV heads' (and their k/v
# adapters') across devices; TP=2 splits them only: `make test-full`'s.
@pytest.mark.parametrize("tp", [pytest.param(2, marks=pytest.mark.full), 4])
def test_adapters_under_tensor_parallelism_generate_the_merged_models_tokens(tmp_path, tp):
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(str(tmp_path / "model"), seed=4)  # 4 query heads, 2 KV heads
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    references, loras = {None: hf}, {None: None}
    for i, name in enumerate(("all", "qv")):
        rank, alpha, targets, rslora = ADAPTERS[name]
        adapter = str(tmp_path / name)
        weights = write_adapter(adapter, hf, rank=rank, alpha=alpha, targets=targets, seed=20 + i, std=0.2)
        references[name] = merged(hf, weights, scaling(rank, alpha, rslora))
        loras[name] = [name, i + 1, adapter]
    rng = np.random.default_rng(5)
    prompts = [[1, *rng.integers(3, 384, n).tolist()] for n in (6, 11, 3, 8)]
    runs = [
        {
            "tp": tp,
            "prompts": prompts,
            "new_tokens": NEW_TOKENS,
            "llm": ENGINE,
            "loras": [loras[n] for n in NAMES],
        }
    ]
    results = _run_engines(tmp_path, path, runs, "xla")
    for run in results:
        assert run["stats"]["compiles_after_warmup"] == 0
        for prompt, name, tokens, logprobs in zip(
            prompts, NAMES, run["tokens"], run["logprobs"], strict=True
        ):
            reference = references[name]
            assert tokens == hf_greedy(reference, prompt, NEW_TOKENS), name
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
            want = torch.log_softmax(logits, -1)[torch.arange(NEW_TOKENS), tokens].numpy()
            np.testing.assert_allclose(logprobs, want, atol=2e-3, err_msg=str(name))
        qkv = run["params"]["model.layers.0.self_attn.qkv_proj.lora.b"]
        assert qkv["shape"][0] == 3  # max_loras + 1 slots
