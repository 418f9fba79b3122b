# SPDX-License-Identifier: Apache-2.0
"""vLLM's pooling runner on the XLA platform: a `*ForSequenceClassification` checkpoint's score
head (Llama, three labels: softmax) against transformers' logits, single and batched."""

import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForSequenceClassification
from vllm import LLM, PoolingParams
from vllm.inputs import TokensPrompt

from tests.models.tiny_checkpoints import prompts, save_tiny

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("LlamaForSequenceClassification", str(tmp_path_factory.mktemp("cls_llama")), seed=5)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return LlamaForSequenceClassification.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    engine = LLM(
        model=tiny_dir, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
        block_size=16, seed=0,
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def _classify(llm, batch, **params):
    outs = llm.classify(
        [TokensPrompt(prompt_token_ids=ids) for ids in batch], pooling_params=PoolingParams(**params)
    )
    return [np.asarray(o.outputs.probs, np.float32) for o in outs]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.slow
def test_a_classifier_checkpoint_resolves_to_the_classify_task(llm):
    mc = llm.llm_engine.vllm_config.model_config
    assert (mc.runner_type, mc.convert_type) == ("pooling", "classify")
    assert tuple(llm.supported_tasks) == ("classify",)


@pytest.mark.slow
def test_single_prompt_probabilities_are_the_softmax_of_transformers_logits(llm, hf):
    (ids,) = prompts([12], seed=6)
    (got,) = _classify(llm, [ids])
    assert got.shape == (3,)
    np.testing.assert_allclose(got, _softmax(hf_logits(hf, ids)), atol=ATOL)


@pytest.mark.slow
def test_batched_raw_logits_match_transformers(llm, hf):
    batch = prompts([3, 25, 8, 60, 14], seed=7)
    got = _classify(llm, batch, use_activation=False)
    for ids, row in zip(batch, got, strict=True):
        np.testing.assert_allclose(row, hf_logits(hf, ids), atol=ATOL)


@pytest.mark.slow
def test_no_compiles_after_warm_up_over_varied_batches(llm):
    for lengths in ([2], [31, 4], [64, 1, 1], [90], [9, 9, 9, 9]):
        _classify(llm, prompts(lengths, seed=sum(lengths)))
    assert llm.collective_rpc("runner_stats")[0]["compiles_after_warmup"] == 0
