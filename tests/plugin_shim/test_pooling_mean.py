# SPDX-License-Identifier: Apache-2.0
"""vLLM's pooling runner on the XLA platform: a Qwen3 causal LM as an embedder with mean pooling
(vLLM then schedules each prompt whole), against transformers' hidden states."""

import gc

import numpy as np
import pytest
import torch
from transformers import Qwen3ForCausalLM
from vllm import LLM

from tests.models.tiny_checkpoints import prompts, save_tiny
from tests.plugin_shim.test_pooling_embed import _embed, _normalized

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("Qwen3ForCausalLM", str(tmp_path_factory.mktemp("mean_qwen3")), seed=11)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return Qwen3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    engine = LLM(
        model=tiny_dir, runner="pooling", convert="embed", pooler_config={"pooling_type": "MEAN"},
        dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
        seed=0,
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()


def hf_mean(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()


@pytest.mark.slow
def test_vllm_schedules_mean_pooled_prompts_whole(llm):
    config = llm.llm_engine.vllm_config
    assert config.model_config.pooler_config.seq_pooling_type == "MEAN"
    assert not config.scheduler_config.enable_chunked_prefill
    assert not config.cache_config.enable_prefix_caching


@pytest.mark.slow
def test_single_prompt_is_the_normalized_mean_hidden_state(llm, hf):
    (ids,) = prompts([21], seed=12)
    (got,) = _embed(llm, [ids])
    np.testing.assert_allclose(got, _normalized(hf_mean(hf, ids)), atol=ATOL)


@pytest.mark.slow
def test_batched_means_match_one_by_one(llm, hf):
    batch = prompts([6, 40, 1, 17], seed=13)
    got = _embed(llm, batch, use_activation=False)
    for ids, row in zip(batch, got, strict=True):
        np.testing.assert_allclose(row, hf_mean(hf, ids), atol=ATOL)


@pytest.mark.slow
def test_no_compiles_after_warm_up_over_varied_batches(llm):
    for lengths in ([2], [50, 3], [64], [5, 5, 5, 5], [30, 30]):
        _embed(llm, prompts(lengths, seed=sum(lengths)))
    assert llm.collective_rpc("runner_stats")[0]["compiles_after_warmup"] == 0
