# SPDX-License-Identifier: Apache-2.0
"""Load per expert: a tiny Mixtral served by vLLM counts, in its jitted step, the tokens each MoE
layer routes to each expert; the totals equal a NumPy count of the top-k of transformers' router
logits over every token the engine ran (each prompt and its generated tokens but the last),
padding not counted, with no compile after warm-up. The worker's counters (what `/metrics`
exports) hold the sums over the layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.models.tiny_checkpoints import prompts, save_tiny

pytestmark = pytest.mark.slow  # a vLLM engine

NEW_TOKENS = 4
PROMPTS = prompts([7, 12, 3], seed=21)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = save_tiny("MixtralForCausalLM", str(tmp_path_factory.mktemp("expert_load") / "model"), seed=8)
    engine = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, seed=0)
    llm = LLM(model=model, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    generated = [list(o.outputs[0].token_ids) for o in done]
    per_layer = np.array(llm.collective_rpc(lambda worker: worker.runner.expert_load.tolist())[0])
    stats = llm.collective_rpc("runner_stats")[0]
    yield model, generated, per_layer, stats
    del llm


def _router_top_k_counts(model_dir: str, sequences: list[list[int]]) -> np.ndarray:
    """`[L, E]`: over `sequences`, how often each layer's top-k of transformers' router logits
    holds each expert (NumPy's own top-k)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    top_k, num_experts = hf.config.num_experts_per_tok, hf.config.num_local_experts
    counts = np.zeros((hf.config.num_hidden_layers, num_experts), np.int64)
    with torch.no_grad():
        for ids in sequences:
            out = hf(torch.tensor([ids]), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                chosen = np.argsort(-logits.reshape(len(ids), num_experts).numpy(), axis=-1)[:, :top_k]
                counts[layer] += np.bincount(chosen.reshape(-1), minlength=num_experts)
    return counts


def test_tokens_per_expert_equal_a_numpy_count_of_the_routers_top_k(served):
    model, generated, per_layer, _ = served
    ran = [p + g[:-1] for p, g in zip(PROMPTS, generated, strict=True)]  # the last token is never fed
    want = _router_top_k_counts(model, ran)
    np.testing.assert_array_equal(per_layer, want)
    assert per_layer.sum(axis=1).tolist() == [2 * sum(map(len, ran))] * 2  # top-2, real tokens only


def test_the_published_counters_sum_each_expert_over_the_layers(served):
    _, _, per_layer, stats = served
    exported = [stats[f"expert_tokens.{e}"] for e in range(per_layer.shape[1])]
    assert exported == per_layer.sum(axis=0).tolist()
    assert stats["compiles_after_warmup"] == 0
