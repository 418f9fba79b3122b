# SPDX-License-Identifier: Apache-2.0
"""vLLM's pooling runner on the XLA platform: a causal LM served as an embedder (last-token
pooling, `convert="embed"`), against transformers' hidden states; scoring; no compiles after warm-up."""

import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from vllm import LLM, PoolingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from tests.models.tiny_checkpoints import prompts
from tests.tiny_models import save_tiny_llama

ATOL = 1e-4
DIMENSIONS = 16  # a Matryoshka width the checkpoint declares


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = save_tiny_llama(str(tmp_path_factory.mktemp("embed_llama")), seed=3)
    _declare_matryoshka(path)
    return path


def _declare_matryoshka(path: str) -> None:
    import json
    import os

    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["matryoshka_dimensions"] = [DIMENSIONS, 32, 64]
    with open(config_path, "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    engine = LLM(
        model=tiny_dir, runner="pooling", convert="embed", dtype="float32", max_model_len=128,
        max_num_seqs=4, max_num_batched_tokens=64, block_size=16, seed=0,
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()


def hf_hidden(hf, ids: list[int]) -> np.ndarray:
    """transformers' last hidden states (after the final norm) of one prompt, `[n, D]`."""
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].numpy()


def _normalized(x: np.ndarray) -> np.ndarray:
    return x / max(np.linalg.norm(x), 1e-12)


def _embed(llm, ids_list, **params):
    outs = llm.embed(
        [TokensPrompt(prompt_token_ids=ids) for ids in ids_list], pooling_params=PoolingParams(**params)
    )
    return [np.asarray(o.outputs.embedding, np.float32) for o in outs]


@pytest.mark.slow
def test_supported_tasks_are_the_embedders(llm):
    assert llm.llm_engine.vllm_config.model_config.runner_type == "pooling"
    assert tuple(llm.supported_tasks) == ("embed",)


@pytest.mark.slow
def test_single_prompt_embedding_is_the_normalized_last_hidden_state(llm, hf):
    (ids,) = prompts([11], seed=1)
    (got,) = _embed(llm, [ids])
    np.testing.assert_allclose(got, _normalized(hf_hidden(hf, ids)[-1]), atol=ATOL)


@pytest.mark.slow
def test_batched_embeddings_match_one_by_one(llm, hf):
    batch = prompts([5, 17, 9, 30, 2], seed=2)
    got = _embed(llm, batch)
    for ids, row in zip(batch, got, strict=True):
        np.testing.assert_allclose(row, _normalized(hf_hidden(hf, ids)[-1]), atol=ATOL)


@pytest.mark.slow
def test_unnormalized_embedding_is_the_raw_hidden_state(llm, hf):
    (ids,) = prompts([7], seed=3)
    (got,) = _embed(llm, [ids], use_activation=False)
    np.testing.assert_allclose(got, hf_hidden(hf, ids)[-1], atol=ATOL)


@pytest.mark.slow
def test_dimensions_truncate_before_normalizing(llm, hf):
    a, b = prompts([6, 13], seed=4)
    got = llm.embed(
        [TokensPrompt(prompt_token_ids=a), TokensPrompt(prompt_token_ids=b)],
        pooling_params=[PoolingParams(dimensions=DIMENSIONS), PoolingParams()],
    )
    first, second = (np.asarray(o.outputs.embedding, np.float32) for o in got)
    assert first.shape == (DIMENSIONS,) and second.shape == (64,)
    np.testing.assert_allclose(first, _normalized(hf_hidden(hf, a)[-1][:DIMENSIONS]), atol=ATOL)
    np.testing.assert_allclose(second, _normalized(hf_hidden(hf, b)[-1]), atol=ATOL)


@pytest.mark.slow
def test_dimensions_outside_the_matryoshka_list_are_refused(llm):
    (ids,) = prompts([4])
    with pytest.raises(VLLMValidationError, match="Matryoshka"):
        _embed(llm, [ids], dimensions=20)


@pytest.mark.slow
def test_a_prompt_longer_than_a_step_is_chunked_and_pools_its_last_token(llm, hf):
    # 100 tokens over 64-token steps: last-token pooling keeps vLLM's chunked prefill.
    assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
    (ids,) = prompts([100], seed=5)
    (got,) = _embed(llm, [ids])
    np.testing.assert_allclose(got, _normalized(hf_hidden(hf, ids)[-1]), atol=ATOL)


@pytest.mark.slow
def test_a_prefix_cache_hit_pools_the_last_token_all_the_same(llm, hf):
    # Last-token pooling keeps vLLM's prefix caching: the second request computes its last token only.
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    (ids,) = prompts([50], seed=14)
    hits = llm.collective_rpc("runner_stats")[0]["prefix_cache_hits"]
    first, second = (_embed(llm, [ids])[0] for _ in range(2))
    assert llm.collective_rpc("runner_stats")[0]["prefix_cache_hits"] == hits + 1
    expected = _normalized(hf_hidden(hf, ids)[-1])
    np.testing.assert_allclose(first, expected, atol=ATOL)
    np.testing.assert_allclose(second, expected, atol=ATOL)


@pytest.mark.slow
def test_score_of_a_pair_is_the_cosine_of_their_embeddings(llm, hf):
    tokenizer = llm.get_tokenizer()
    query, document = "The capital of France", "Paris is the capital of France."
    (out,) = llm.score(query, document)
    a, b = (hf_hidden(hf, tokenizer(text)["input_ids"])[-1] for text in (query, document))
    expected = float(np.dot(_normalized(a), _normalized(b)))
    assert out.outputs.score == pytest.approx(expected, abs=ATOL)


@pytest.mark.slow
def test_encode_with_the_embed_task_gives_the_embeddings(llm, hf):
    (ids,) = prompts([15], seed=8)
    (out,) = llm.encode([TokensPrompt(prompt_token_ids=ids)], pooling_task="embed")
    np.testing.assert_allclose(out.outputs.data.numpy(), _normalized(hf_hidden(hf, ids)[-1]), atol=ATOL)


@pytest.mark.slow
def test_generation_is_refused_by_vllm(llm):
    with pytest.raises(ValueError, match="generat"):
        llm.generate(["hello"])


@pytest.mark.slow
def test_token_wise_pooling_is_refused(llm):
    # Not among the worker's supported tasks: vLLM refuses it before any request is made.
    with pytest.raises(ValueError, match="not supported by this model"):
        llm.encode(["hello"], pooling_task="token_embed")


@pytest.mark.slow
def test_no_compiles_after_warm_up_over_varied_batches(llm):
    for lengths in ([3], [40, 2, 9], [64], [1, 1, 1, 1], [20, 50, 33], [127]):
        _embed(llm, prompts(lengths, seed=len(lengths)))
    stats = llm.collective_rpc("runner_stats")[0]
    assert stats["compiles_after_warmup"] == 0
    keys = llm.collective_rpc(lambda worker: worker.runner.programs.keys())[0]
    assert {key[0] for key in keys} == {"forward", "pool"}  # a pooling engine builds no sampler
