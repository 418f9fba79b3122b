# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters on a pooling engine: an embedder's rows with and without an adapter, each equal to
transformers' normalized last hidden state of the base model or of the adapter merged in."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from vllm import LLM
from vllm.lora.request import LoRARequest

from tests.lora_adapters import merged, scaling, write_adapter
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # an engine

PROMPTS = [[1, 5, 9, 33, 70, 12], [1, 44, 2, 19]]
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_pooling")
    path = save_tiny_llama(str(root / "model"))
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    adapter = str(root / "adapter")
    weights = write_adapter(
        adapter, hf, rank=RANK, alpha=ALPHA, targets=["q_proj", "v_proj", "gate_proj"], seed=1
    )
    llm = LLM(
        model=path, runner="pooling", convert="embed", dtype="float32", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=64, block_size=16, seed=0, enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    yield llm, hf, merged(hf, weights, scaling(RANK, ALPHA)), LoRARequest("adapter", 1, adapter)
    del llm
    gc.collect()


def _embedding(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        last = model.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    return last / np.linalg.norm(last)


def test_an_embedder_with_and_without_an_adapter_matches_transformers(setup):
    llm, hf, with_adapter, request = setup
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    base = llm.embed(prompts)
    adapted = llm.embed(prompts, lora_request=request)
    for ids, b, a in zip(PROMPTS, base, adapted, strict=True):
        want_base, want_adapted = _embedding(hf, ids), _embedding(with_adapter, ids)
        assert np.abs(want_adapted - want_base).max() > 1e-2  # the adapter changes the embedding
        np.testing.assert_allclose(b.outputs.embedding, want_base, atol=1e-4)
        np.testing.assert_allclose(a.outputs.embedding, want_adapted, atol=1e-4)


def test_an_unreadable_adapter_ends_its_request_with_an_empty_vector_and_the_engine_goes_on(setup, tmp_path):
    """vLLM gives a worker no way to fail one request: the request whose adapter cannot be read
    ends with an empty vector; its step's other request and the next calls are served."""
    llm, hf, _, _ = setup
    missing = LoRARequest("missing", 2, str(tmp_path / "never-written"))
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    mixed = llm.embed(prompts, lora_request=[missing, None])
    assert len(mixed[0].outputs.embedding) == 0
    np.testing.assert_allclose(mixed[1].outputs.embedding, _embedding(hf, PROMPTS[1]), atol=1e-4)
    after = llm.embed(prompts[:1])
    np.testing.assert_allclose(after[0].outputs.embedding, _embedding(hf, PROMPTS[0]), atol=1e-4)
