# SPDX-License-Identifier: Apache-2.0
"""vLLM's OpenAI server on our platform as an embedding server: `/v1/embeddings` to the OpenAI
client, and `/pooling` through an IO-processor plugin installed by its entry point."""

import os

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.io_processor_plugin import NAME, install, word_token_ids
from tests.plugin_shim.served import post, serving
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # starts a server

ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("serve_embed")), seed=4)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve_embed_run")
    site = install(str(work / "site"))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    args = [
        "--model", model_dir, "--runner", "pooling", "--convert", "embed", "--dtype", "float32",
        "--io-processor-plugin", NAME, "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64",
    ]  # fmt: skip
    with serving(args, env, work / "server.log", startup_seconds=300) as base:
        yield base


@pytest.fixture(scope="module")
def hf(model_dir):
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _reference(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    return last / np.linalg.norm(last)


def test_openai_client_gets_embeddings(server, model_dir, hf):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    texts = ["hello world", "The capital of France is Paris.", "jax on tpu"]
    response = client.embeddings.create(model=model_dir, input=texts)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [d.index for d in response.data] == [0, 1, 2]
    for text, item in zip(texts, response.data, strict=True):
        expected = _reference(hf, tokenizer(text)["input_ids"])
        np.testing.assert_allclose(np.asarray(item.embedding), expected, atol=ATOL)
    assert response.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)


def test_io_processor_plugin_serves_its_own_input_and_output(server, model_dir, hf):
    sentences = [["hello", "world"], ["tiny", "models", "pool", "too"]]
    reply = post(f"{server}/pooling", {"model": model_dir, "data": {"sentences": sentences}})
    data = reply["data"]
    assert data["prompt_token_ids"] == [word_token_ids(s) for s in sentences]
    for ids, row, largest in zip(data["prompt_token_ids"], data["embeddings"], data["largest"], strict=True):
        expected = _reference(hf, ids)
        np.testing.assert_allclose(np.asarray(row), expected, atol=ATOL)
        assert largest == int(np.argmax(row))
