# SPDX-License-Identifier: Apache-2.0
"""vLLM's pooling runner on the XLA platform with Qwen3: a one-label classifier (sigmoid) as a
cross-encoder (`LLM.score` of a pair) against transformers."""

import gc

import numpy as np
import pytest
import torch
from transformers import Qwen3ForSequenceClassification
from vllm import LLM
from vllm.inputs import TokensPrompt

from tests.models.tiny_checkpoints import prompts, save_tiny

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("Qwen3ForSequenceClassification", str(tmp_path_factory.mktemp("cls_qwen3")), seed=8)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return Qwen3ForSequenceClassification.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    engine = LLM(
        model=tiny_dir, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
        block_size=16, seed=0,
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def hf_logit(hf, ids: list[int]) -> float:
    with torch.no_grad():
        return float(hf(torch.tensor([ids])).logits[0, 0])


@pytest.mark.slow
def test_classify_is_the_sigmoid_of_the_one_logit(llm, hf):
    batch = prompts([10, 4, 33], seed=9)
    outs = llm.classify([TokensPrompt(prompt_token_ids=ids) for ids in batch])
    for ids, out in zip(batch, outs, strict=True):
        assert out.outputs.probs == pytest.approx([_sigmoid(hf_logit(hf, ids))], abs=ATOL)


@pytest.mark.slow
def test_score_of_a_pair_is_the_cross_encoders_probability(llm, hf):
    query, document = "hello world", "hello vllm, hello xla and jax"
    (out,) = llm.score(query, document)
    ids = llm.get_tokenizer()(query, document)["input_ids"]
    assert out.outputs.score == pytest.approx(_sigmoid(hf_logit(hf, ids)), abs=ATOL)
