# SPDX-License-Identifier: Apache-2.0
"""Multi-LoRA serving through `vllm.LLM(enable_lora=True)`: one batch mixing base-model rows and
three adapters (of different ranks and target modules) generates, row by row, the greedy tokens
and logprobs of transformers with that row's adapter merged into the weights; adapters load,
evict and unload without a compile after warm-up; a broken adapter is refused by name and the
engine keeps serving."""

import gc
import os

import numpy as np
import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

from tests.greedy_reference import hf_greedy
from tests.lora_adapters import merged, scaling, write_adapter
from tests.models.tiny_checkpoints import save_tiny
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # engines

NEW_TOKENS = 6
MAX_RANK = 8
# name -> (rank, alpha, targets, rslora): ranks below max_lora_rank are padded in the slots.
ADAPTERS = {
    "all": (8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "qv": (4, 8.0, ("q_proj", "v_proj"), False),
    "mlp": (2, 4.0, ("o_proj", "gate_proj", "down_proj"), True),
    "late": (8, 8.0, ("k_proj", "up_proj"), False),  # loaded later, evicting a slot
}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def served(request, tmp_path_factory):
    """One engine per architecture, its adapters and their merged transformers references."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    path = str(root / "model")
    if request.param == "LlamaForCausalLM":
        save_tiny_llama(path, seed=3)
    else:
        save_tiny(request.param, path, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    adapters, references = {}, {None: hf}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        adapter_path = str(root / name)
        weights = write_adapter(
            adapter_path, hf, rank=rank, alpha=alpha, targets=targets, seed=10 + i, rslora=rslora, std=0.2
        )
        adapters[name] = LoRARequest(name, i + 1, adapter_path)
        references[name] = merged(hf, weights, scaling(rank, alpha, rslora))
    llm = LLM(
        model=path, dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, seed=0,
        enable_lora=True, max_loras=3, max_lora_rank=MAX_RANK, max_cpu_loras=4,
    )  # fmt: skip
    yield llm, adapters, references, root
    del llm
    gc.collect()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, 384, int(rng.integers(4, 20))).tolist()] for _ in range(n)]


def _generate(llm, prompts, loras):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [
        (
            list(o.outputs[0].token_ids),
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)],
        )
        for o in outputs
    ]


def _reference(hf, prompt):
    """transformers' greedy tokens and their logprobs."""
    tokens = hf_greedy(hf, prompt, NEW_TOKENS)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.double(), -1)[torch.arange(NEW_TOKENS), tokens]
    return tokens, logprobs.numpy()


def _assert_rows_match(results, prompts, names, references):
    for (tokens, logprobs), prompt, name in zip(results, prompts, names, strict=True):
        want_tokens, want_logprobs = _reference(references[name], prompt)
        assert tokens == want_tokens, (name, prompt)
        np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-3, err_msg=str(name))


def test_one_batch_of_base_rows_and_three_adapters_matches_merged_weights(served):
    llm, adapters, references, _ = served
    names = [None, "all", "qv", "mlp", None, "mlp", "qv", "all"]
    prompts = _prompts(len(names), seed=1)
    results = _generate(llm, prompts, [adapters[n] if n else None for n in names])
    _assert_rows_match(results, prompts, names, references)
    # Each adapter changes what its rows generate: the test would see a missing update.
    for name in ("all", "qv", "mlp"):
        base = _reference(references[None], prompts[names.index(name)])
        adapted = _reference(references[name], prompts[names.index(name)])
        assert base[0] != adapted[0] or np.abs(base[1] - adapted[1]).max() > 0.05, name


def test_adapters_load_evict_and_unload_without_compiling(served):
    llm, adapters, references, _ = served
    engine = llm.llm_engine
    warm = llm.collective_rpc("runner_stats")[0]
    assert engine.add_lora(adapters["late"])  # read ahead (vLLM's add_lora / load_lora_adapter)
    assert adapters["late"].lora_int_id in engine.list_loras()
    # Three slots: "late" takes the least recently used one not needed by this batch.
    names = ["late", "all", None, "late"]
    prompts = _prompts(len(names), seed=2)
    _assert_rows_match(
        _generate(llm, prompts, [adapters[n] if n else None for n in names]), prompts, names, references
    )
    assert engine.remove_lora(adapters["qv"].lora_int_id)
    assert adapters["qv"].lora_int_id not in engine.list_loras()
    # A request naming a removed adapter reads it again from its path.
    names = ["qv", "mlp", "late"]
    prompts = _prompts(len(names), seed=3)
    _assert_rows_match(_generate(llm, prompts, [adapters[n] for n in names]), prompts, names, references)
    stats = llm.collective_rpc("runner_stats")[0]
    assert stats["compiles_after_warmup"] == 0
    assert stats["compiles"] == warm["compiles"]


def _broken(root, hf, kind):
    path = str(root / f"broken_{kind}")
    targets = ("q_proj", "v_proj")
    if kind == "rank":
        write_adapter(path, hf, rank=MAX_RANK * 2, alpha=8.0, targets=targets, seed=0)
    elif kind == "missing":
        write_adapter(
            path, hf, rank=4, alpha=8.0, targets=targets, seed=0,
            drop="base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight",
        )  # fmt: skip
    else:  # a LoRA on the embedding or the LM head
        weight = hf.get_submodule(kind).weight
        module = "model.embed_tokens" if kind == "model.embed_tokens" else "lm_head"
        extra = {
            f"base_model.model.{module}.lora_A.weight": np.zeros((4, weight.shape[1]), np.float32),
            f"base_model.model.{module}.lora_B.weight": np.zeros((weight.shape[0], 4), np.float32),
        }
        write_adapter(path, hf, rank=4, alpha=8.0, targets=targets, seed=0, extra=extra)
    return path


@pytest.mark.parametrize(
    "kind, named",
    [
        ("rank", "rank r=16 exceeds max_lora_rank=8"),
        ("missing", "missing tensor base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
        ("model.embed_tokens", "target module 'model.embed_tokens' cannot carry an adapter"),
        ("lm_head", "target module 'lm_head' cannot carry an adapter"),
    ],
)
def test_a_broken_adapter_is_refused_by_name_and_the_engine_keeps_serving(served, kind, named):
    llm, adapters, references, root = served
    hf = references[None]
    if kind == "model.embed_tokens" or kind == "lm_head":
        if kind == "lm_head" and hf.config.tie_word_embeddings:
            kind = "model.embed_tokens"
            named = named.replace("'lm_head'", "'model.embed_tokens'")
    path = _broken(root, hf, kind)
    with pytest.raises(ValueError, match=named) as raised:
        llm.llm_engine.add_lora(LoRARequest(f"broken_{kind}", 90, path))
    assert f"'broken_{kind}'" in str(raised.value)
    assert 90 not in llm.llm_engine.list_loras()
    names = ["all", None]
    prompts = _prompts(len(names), seed=4)
    _assert_rows_match(_generate(llm, prompts, [adapters["all"], None]), prompts, names, references)
    assert os.path.isdir(path)
