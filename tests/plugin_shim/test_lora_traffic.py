# SPDX-License-Identifier: Apache-2.0
"""Multi-LoRA traffic through vLLM's engine, step by step: random requests over more adapters than
`max_cpu_loras` and `max_loras`, with adapters loaded, removed (also while their requests run) and
reloaded in place between steps, for hundreds of steps: the engine never dies and every request's
greedy tokens equal transformers' with its adapter merged. A request whose adapter cannot be read
when its step comes (a bad offline path, files gone after an eviction) fails alone with
`finish_reason` "error" (under a user's scheduler class: ends by its stop token, no text), and the
engine and the other requests go on; a poisoned adapter is refused by name at add_lora."""

import gc
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

from tests.greedy_reference import hf_greedy
from tests.lora_adapters import merged, scaling, write_adapter
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # an engine

NEW_TOKENS = 4
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, alpha, targets); "bf16" is saved in bfloat16, as PEFT usually saves adapters.
ADAPTERS = {
    "all": (8, 16.0, ALL),
    "qv": (4, 8.0, ("q_proj", "v_proj")),
    "mlp": (2, 4.0, ("gate_proj", "up_proj", "down_proj")),
    "ko": (8, 8.0, ("k_proj", "o_proj")),
    "bf16": (4, 8.0, ALL),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


class Adapters:
    """The adapters on disk, their LoRARequests and their merged transformers references."""

    def __init__(self, root, hf):
        self.root, self.hf = root, hf
        self.requests: dict[str, LoRARequest] = {}
        self.references = {None: hf}
        self._version = 0
        for i, name in enumerate(ADAPTERS):
            self.write(name, i + 1, seed=10 + i)
        self._greedy: dict[tuple, list[int]] = {}

    def write(self, name, lora_id, seed):
        """Writes adapter `name` anew (a new path and weights) under `lora_id`."""
        rank, alpha, targets = ADAPTERS[name]
        self._version += 1
        path = str(self.root / f"{name}_{self._version}")
        weights = write_adapter(path, self.hf, rank=rank, alpha=alpha, targets=targets, seed=seed, std=0.2)
        if name == "bf16":
            weights = _to_bfloat16(path, weights)
        self.requests[name] = LoRARequest(name, lora_id, path)
        self.references[name] = merged(self.hf, weights, scaling(rank, alpha))
        self._greedy = {k: v for k, v in getattr(self, "_greedy", {}).items() if k[0] != name}

    def greedy(self, name, prompt):
        key = (name, tuple(prompt))
        if key not in self._greedy:
            self._greedy[key] = hf_greedy(self.references[name], prompt, NEW_TOKENS)
        return self._greedy[key]


def _to_bfloat16(path, weights):
    """Saves the adapter at `path` in bfloat16; the weights as the engine will read them."""
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "adapter_model.safetensors")
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(file).items()}, file)
    rounded = {}
    for module, pair in weights.items():
        rounded[module] = tuple(x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in pair)
    return rounded


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_traffic")
    path = save_tiny_llama(str(root / "model"), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(
        model=path, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, seed=0,
        enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
    )  # fmt: skip
    yield llm, Adapters(root, hf)
    del llm
    gc.collect()


def _prompt(rng) -> list[int]:
    return [1, *rng.integers(3, 384, int(rng.integers(3, 12))).tolist()]


def test_random_traffic_over_more_adapters_than_slots_and_cache(served):
    llm, adapters = served
    engine, rng = llm.llm_engine, np.random.default_rng(0)
    names = [None, *ADAPTERS]
    running: dict[str, tuple[str | None, list[int]]] = {}
    steps = finished = removed_in_use = 0
    while steps < 200:  # the engine runs some 250 steps
        action = rng.random()
        name = str(rng.choice(list(ADAPTERS)))
        request = adapters.requests[name]
        if action < 0.1:
            engine.add_lora(request)  # read ahead, or a cache hit
        elif action < 0.2:
            in_use = any(n == name for n, _ in running.values())
            removed_in_use += in_use
            engine.remove_lora(request.lora_int_id)  # its running requests keep it
            assert request.lora_int_id not in engine.list_loras()
        elif action < 0.25 and not running:  # new weights at a new path, loaded in place
            adapters.write(name, request, seed=int(rng.integers(100, 10_000)))
            assert engine.add_lora(
                LoRARequest(name, request.lora_int_id, adapters.requests[name].lora_path, load_inplace=True)
            )
        for _ in range(int(rng.integers(0, 3))):
            req_id, name = f"r{steps}_{len(running)}", names[int(rng.integers(len(names)))]
            prompt = _prompt(rng)
            lora = adapters.requests[name] if name else None
            engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), GREEDY, lora_request=lora)
            running[req_id] = (name, prompt)
        for output in engine.step():
            if output.finished:
                name, prompt = running.pop(output.request_id)
                assert list(output.outputs[0].token_ids) == adapters.greedy(name, prompt), (name, prompt)
                finished += 1
        steps += 1
    while running:
        for output in engine.step():
            if output.finished:
                name, prompt = running.pop(output.request_id)
                assert list(output.outputs[0].token_ids) == adapters.greedy(name, prompt), (name, prompt)
                finished += 1
    assert finished > 60 and removed_in_use > 0
    assert llm.collective_rpc("runner_stats")[0]["compiles_after_warmup"] == 0


def test_a_request_whose_adapter_cannot_be_read_fails_alone(served, tmp_path):
    llm, adapters = served
    prompts = [[1, 5, 9, 17], [1, 40, 41], [1, 7, 8, 9, 10]]
    bad = LoRARequest("nowhere", 77, str(tmp_path / "nowhere"))
    stop = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [GREEDY, stop, GREEDY],
        lora_request=[adapters.requests["qv"], bad, None],
        use_tqdm=False,
    )
    assert list(outputs[0].outputs[0].token_ids) == adapters.greedy("qv", prompts[0])
    assert list(outputs[2].outputs[0].token_ids) == adapters.greedy(None, prompts[2])
    refused = outputs[1].outputs[0]
    assert list(refused.token_ids) == [] and refused.text == "" and refused.finish_reason == "error"
    # An adapter evicted from the host cache (3 adapters) whose files are gone since.
    gone = adapters.requests["ko"]
    copy = str(tmp_path / "ko")
    shutil.copytree(gone.lora_path, copy)
    gone = LoRARequest("ko_copy", 78, copy)
    assert llm.llm_engine.add_lora(gone)
    for name in ("all", "qv", "mlp"):  # the three most recently used
        llm.llm_engine.add_lora(adapters.requests[name])
    assert 78 not in llm.llm_engine.list_loras()
    shutil.rmtree(copy)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts[:2]],
        [stop, GREEDY],
        lora_request=[gone, adapters.requests["mlp"]],
        use_tqdm=False,
    )
    assert list(outputs[0].outputs[0].token_ids) == [] and outputs[0].outputs[0].finish_reason == "error"
    assert list(outputs[1].outputs[0].token_ids) == adapters.greedy("mlp", prompts[1])


def test_under_a_user_scheduler_class_the_request_ends_by_its_stop_token(served, tmp_path):
    """A scheduler class of the user's own is kept: the request whose adapter cannot be read is
    then ended by the worker's fallback, its stop token and no text, and the others are served."""
    llm, adapters = served
    own = LLM(
        model=llm.llm_engine.model_config.model, dtype="float32", max_model_len=64, max_num_seqs=2,
        max_num_batched_tokens=32, seed=0, enable_lora=True, max_loras=1, max_lora_rank=8,
        scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler",
    )  # fmt: skip
    prompts = [[1, 5, 9, 17], [1, 40, 41]]
    bad = LoRARequest("nowhere", 77, str(tmp_path / "nowhere"))
    outputs = own.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), GREEDY],
        lora_request=[bad, None],
        use_tqdm=False,
    )
    refused = outputs[0].outputs[0]
    assert list(refused.token_ids) == [2] and refused.text == "" and refused.finish_reason == "stop"
    assert list(outputs[1].outputs[0].token_ids) == adapters.greedy(None, prompts[1])
    del own
    gc.collect()


@pytest.mark.parametrize(
    "poison, named",
    [
        ("nan_tensor", "holds NaN or infinite values"),
        ("nan_alpha", "lora_alpha=nan in adapter_config.json is not a finite number"),
        ("regex", "a quantifier after a quantifier"),
    ],
)
def test_a_poisoned_adapter_is_refused_by_name_and_serving_goes_on(served, tmp_path, poison, named):
    llm, adapters = served
    path = str(tmp_path / poison)
    weights = write_adapter(path, adapters.hf, rank=2, alpha=4.0, targets=("q_proj",), seed=5)
    config_file = os.path.join(path, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    if poison == "nan_tensor":
        from safetensors.numpy import save_file

        module = next(iter(weights))
        b = weights[module][1].copy()
        b[0, 0] = np.nan
        tensors = {f"base_model.model.{m}.lora_{w}.weight": v for m, (x, y) in weights.items()
                   for w, v in (("A", x), ("B", b if m == module else y))}  # fmt: skip
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    elif poison == "nan_alpha":
        config["lora_alpha"] = float("nan")
    else:
        config["target_modules"] = r".*q_proj++"
    with open(config_file, "w") as f:
        json.dump(config, f)  # Python writes NaN, and reads it back
    with pytest.raises(ValueError, match=named) as raised:
        llm.llm_engine.add_lora(LoRARequest(poison, 90, path))
    assert f"'{poison}'" in str(raised.value) and 90 not in llm.llm_engine.list_loras()
    prompt = [1, 11, 12, 13]
    (output,) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)], GREEDY, lora_request=adapters.requests["all"], use_tqdm=False
    )
    assert list(output.outputs[0].token_ids) == adapters.greedy("all", prompt)
