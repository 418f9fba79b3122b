# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V2 and V3 through `vllm.LLM` on our platform, at TP=1, 2 and 4 on simulated CPU
devices (one subprocess for every checkpoint and tier the session runs, as in
test_tensor_parallel.py): greedy tokens equal
transformers' fp32 greedy continuation and logprobs agree; vLLM sized the cache from our MLA
spec, so the latent cache holds `kv_lora_rank + qk_rope_head_dim` values a token a layer, whole
on every device; the heads' projections are split as the rules table says (at TP=4 one head a
device). Prefix caching, chunked prefill and preemption each leave V3's tokens transformers';
a float8 latent cache gives transformers' tokens with the cached values rounded as it
rounds them; Kimi K2's config (`model_type: kimi_k2`) serves as V3.

`make test` runs V2-Lite at TP=4 (one head a device), V3 at TP=2 through the serving features
(cached, chunked, preempted) and with a float8 cache at TP=1, and Kimi K2 at TP=1; the greedy
runs at the other sizes and V3's plain TP=2 run (`MORE_RUNS`) are `make test-full`'s.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np
import pytest

from models import ModelConfig
from models.deepseek_config import DeepseekConfig
from models.sharding import parameter_spec
from tests.models.tiny_checkpoints import hf_logits
from tests.models.tiny_deepseek import LATENT_WIDTH, save_tiny_deepseek, save_tiny_kimi_k2
from tests.plugin_shim.test_tensor_parallel import (
    ENGINE,
    LOGPROB_ATOL,
    _case,
    _features_run,
    _greedy_run,
    _hf_reference,
    _normalized,
    _run_engines,
)

pytestmark = pytest.mark.slow  # engines on simulated multi-device hosts

PAGE = 16
# Engine options of every run: 16-token pages (the CPU default is 128; DeepSeek's real page).
PAGED = dict(block_size=PAGE)


def _plain_run(tp: int) -> dict:
    """The features run's prompts in 64-token steps, nothing cached or preempted."""
    features = _features_run(tp)
    llm = {**ENGINE, **PAGED, "max_num_batched_tokens": 64, "enable_prefix_caching": False}
    return {**features, "mixed": False, "llm": llm}


def _cached_chunked_preempted_run(tp: int) -> dict:
    """Shared 40-token prefixes, 8-token steps, 9 pages for four sequences, and vLLM's counters."""
    features = _features_run(tp)
    return {**features, "llm": {**features["llm"], "disable_log_stats": False}}


def _fp8_run(tp: int) -> dict:
    return _greedy_run(tp, **PAGED, kv_cache_dtype="fp8")


# checkpoint -> (architecture, builder, runs by name in `make test`). V3 with every serving feature
# at TP=2 and a float8 cache at TP=1; V2-Lite (no q LoRA, softmax routing) split 4 ways, one head
# a device (its one-device step is the logits tests' in tests/models/test_deepseek.py); Kimi K2 on
# one device.
CHECKPOINTS = {
    "v2_lite_greedy": (
        "DeepseekV2ForCausalLM",
        lambda path: save_tiny_deepseek("v2_lite_greedy", path),
        {"tp4": _greedy_run(4, **PAGED)},
    ),
    "v3_noaux_yarn": (
        "DeepseekV3ForCausalLM",
        lambda path: save_tiny_deepseek("v3_noaux_yarn", path),
        {"features": _cached_chunked_preempted_run(2), "fp8": _fp8_run(1)},
    ),
    "kimi_k2": ("DeepseekV3ForCausalLM", save_tiny_kimi_k2, {"tp1": _greedy_run(1, **PAGED)}),
}
# Greedy runs at every TP size (`make test-full`): they repeat at other sizes what the runs above
# check (V3's one-device step is Kimi K2's and the float8 run's, its TP=2 the feature runs'); V3's
# plain run, which the feature run's tokens equal when both equal transformers'.
MORE_RUNS = {
    "v2_lite_greedy": {"tp2": _greedy_run(2, **PAGED)},
    "v3_noaux_yarn": {
        "plain": _plain_run(2),
        "tp1": _greedy_run(1, **PAGED),
        "tp2": _greedy_run(2, **PAGED),
        "tp4": _greedy_run(4, **PAGED),
    },
}
CASES = [pytest.param(name, False, id=name) for name in CHECKPOINTS] + [
    pytest.param(name, True, id=f"{name}-more", marks=pytest.mark.full) for name in MORE_RUNS
]
# Runs whose tokens are transformers' exactly (the float8 cache's: its own test).
EXACT = ("tp1", "tp2", "tp4", "plain", "features")


def _reference_checkpoint(path: str) -> str:
    """transformers converts a checkpoint's per-expert weights by its `model_type`, which it knows
    as `deepseek_v3` only: the same files under that type, for the reference."""
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    if config.get("model_type") == "deepseek_v3":
        return path
    reference = f"{path}_as_deepseek_v3"
    shutil.copytree(path, reference)
    with open(f"{reference}/config.json", "w") as f:
        json.dump({**config, "model_type": "deepseek_v3"}, f)
    return reference


class _Served:
    """Each checkpoint's engine runs and transformers' greedy tokens and logprobs for each run's
    prompts. On first use the runs of every case this session selected (`wanted`) run together,
    one subprocess for all of them."""

    def __init__(self, tmp_path_factory, wanted: set[tuple[str, bool]]):
        self._tmp = tmp_path_factory
        self._wanted = wanted
        self._checkpoints: dict[str, tuple] = {}
        self._done: dict[tuple[str, bool], tuple] = {}

    def _checkpoint(self, name: str) -> tuple:
        if name not in self._checkpoints:
            tmp = self._tmp.mktemp(name)
            path = CHECKPOINTS[name][1](str(tmp / "model"))
            self._checkpoints[name] = (tmp, path, _reference_checkpoint(path))
        return self._checkpoints[name]

    def _runs(self, name: str, more: bool) -> dict[str, dict]:
        return MORE_RUNS[name] if more else CHECKPOINTS[name][2]

    def __call__(self, name: str, more: bool = False) -> tuple[dict, dict, dict, str]:
        if (name, more) not in self._done:
            cases = [(name, more), *sorted(self._wanted - {(name, more)} - set(self._done))]
            jobs = [
                {**run, "model": self._checkpoint(n)[1]}
                for n, m in cases
                for run in self._runs(n, m).values()
            ]
            results = iter(_run_engines(self._tmp.mktemp("runs"), "", jobs, "xla"))
            for n, m in cases:
                runs, reference_path = self._runs(n, m), self._checkpoint(n)[2]
                references = {
                    run_name: _hf_reference(CHECKPOINTS[n][0], reference_path, run["prompts"])
                    for run_name, run in runs.items()
                }
                done = {run_name: next(results) for run_name in runs}
                self._done[(n, m)] = (runs, done, references, reference_path)
        return self._done[(name, more)]


@pytest.fixture(scope="module")
def served(request, tmp_path_factory) -> _Served:
    here = request.node.path
    wanted = {_case(item) for item in request.session.items if item.path == here} - {None}
    return _Served(tmp_path_factory, wanted)


@pytest.mark.parametrize(("name", "more"), CASES)
def test_greedy_tokens_and_logprobs_match_transformers(served, name, more):
    runs, results, references, _ = served(name, more)
    for run_name in (r for r in runs if r in EXACT):
        tokens, logprobs = references[run_name]
        assert results[run_name]["tokens"] == tokens, run_name
        np.testing.assert_allclose(
            np.asarray(results[run_name]["logprobs"]),
            np.asarray(logprobs),
            atol=LOGPROB_ATOL,
            err_msg=run_name,
        )


@pytest.mark.parametrize(("name", "more"), CASES)
def test_latent_cache_holds_one_row_a_token_whole_on_every_device(served, name, more):
    runs, results, _, _ = served(name, more)
    for run_name, run in runs.items():
        tp, result = run["tp"], results[run_name]
        (cache,) = result["caches"]  # every layer's pages stacked in one array
        pages, row = cache["shape"]
        # (kv_lora_rank + qk_rope_head_dim) values a token a layer: float32, or one byte in float8
        itemsize = 1 if run["llm"].get("kv_cache_dtype") == "fp8" else 4
        assert row == PAGE * LATENT_WIDTH, run_name
        assert cache["bytes"] == pages * PAGE * LATENT_WIDTH * itemsize, run_name
        assert cache["devices"] == tp and cache["device_bytes"] == [cache["bytes"]] * tp, run_name
        assert _normalized(cache["spec"]) == []


@pytest.mark.parametrize(("name", "more"), [c for c in CASES if c.values[0] != "kimi_k2"])
def test_heads_are_split_as_the_rules_table_says(served, name, more):
    runs, results, _, _ = served(name, more)
    assert any(run["tp"] > 1 for run in runs.values())
    for run_name, run in runs.items():
        tp, result = run["tp"], results[run_name]
        if tp == 1:
            continue
        split = set()
        for path, placed in result["params"].items():
            expected = parameter_spec(path, tuple(placed["shape"]), tp)
            assert _normalized(placed["spec"]) == _normalized(list(expected)), path
            if any(expected):
                assert placed["device_bytes"] == [placed["bytes"] // tp] * tp, path
                split.add(path.rsplit(".", 2)[-2])
        assert {"kv_b_proj", "o_proj", "gate_proj", "down_proj"} <= split, split
        assert "kv_a_proj_with_mqa" not in split


def test_prefix_hits_chunked_prefill_and_preemption_leave_transformers_tokens(served):
    """The tokens a plain run gives (`make test-full` runs one): transformers' own."""
    _, results, references, _ = served("v3_noaux_yarn")
    features, (tokens, logprobs) = results["features"], references["features"]
    assert features["tokens"] == tokens
    np.testing.assert_allclose(features["logprobs"], logprobs, atol=LOGPROB_ATOL)
    stats, warm, counters = features["stats"], features["warm"], features["vllm"]
    assert stats["partial_prefill_steps"] > 0  # prompts of 42-51 tokens in 8-token steps
    # vLLM's own counters: the shared prefix's pages were found cached, and requests preempted
    assert counters["vllm:prefix_cache_hits"] >= 2 * PAGE, counters
    assert counters["vllm:num_preemptions"] > 0, counters
    assert stats["preempted_requests"] > 0 and stats["resumed_requests"] > 0
    assert stats["compiles_after_warmup"] == 0 and stats["compiles"] == warm["compiles"]


E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value: the cache write saturates there
# The float8 run against transformers with the same rounding: only a value landing on the other
# side of a float8 rounding boundary (float32 sums in another order) could move a logprob.
FP8_LOGPROB_ATOL = 1e-2


def _e4m3(x):
    import torch

    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


@contextlib.contextmanager
def _float8_latent_cache(hf):
    """transformers' DeepSeek-V3 with what a float8 latent cache holds rounded to e4m3: each
    token's normalized latent (`kv_a_layernorm`'s output) and its rotated rope key."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    hooks = [
        layer.self_attn.kv_a_layernorm.register_forward_hook(lambda module, inputs, out: _e4m3(out))
        for layer in hf.model.layers
    ]
    originals = {n: getattr(modeling, n) for n in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")}

    def rounding_keys(rotate):
        def rotated(*args, **kwargs):
            q, k = rotate(*args, **kwargs)
            return q, _e4m3(k)

        return rotated

    for name, rotate in originals.items():
        setattr(modeling, name, rounding_keys(rotate))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for name, rotate in originals.items():
            setattr(modeling, name, rotate)


def test_float8_latent_cache_is_transformers_with_float8_latents(served):
    """A float8 (e4m3) cache rounds each latent and rope-key value to 3 mantissa bits; this tiny
    random model's attention is sharp enough that the rounding moves its logprobs by up to ~1 and
    flips greedy tokens against the exact model, so the reference rounds the same values:
    transformers with the cached latent and rope key rounded to e4m3 (what each step reads back),
    whose greedy tokens the float8 engine must give exactly, logprobs within FP8_LOGPROB_ATOL."""
    import torch
    import transformers

    runs, results, _, reference_path = served("v3_noaux_yarn")
    run, result = runs["fp8"], results["fp8"]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        reference_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with _float8_latent_cache(hf):
        for prompt, tokens, logprobs in zip(
            run["prompts"], result["tokens"], result["logprobs"], strict=True
        ):
            ids = list(prompt)
            for token, logprob in zip(tokens, logprobs, strict=True):
                logits = hf_logits(hf, ids)[-1].astype(np.float64)
                log_softmax = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
                assert token == int(np.argmax(logits)), (prompt, ids[len(prompt) :], token)
                assert abs(log_softmax[token] - logprob) <= FP8_LOGPROB_ATOL, (prompt, ids[len(prompt) :])
                ids.append(token)


def test_kimi_k2_config_is_read_as_deepseek_v3(served):
    """Its tokens are transformers' (the greedy test); here: the engine read `kimi_k2`'s fields."""
    _, results, _, reference_path = served("kimi_k2")
    path = reference_path.removesuffix("_as_deepseek_v3")
    with open(f"{path}/config.json") as f:
        kimi = json.load(f)
    assert kimi["model_type"] == "kimi_k2" and kimi["rope_scaling"]["type"] == "yarn"
    config = ModelConfig.from_pretrained(path)
    assert isinstance(config, DeepseekConfig)
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (1, 1, 2.827)
    assert config.yarn is not None and (config.yarn.factor, config.yarn.beta_fast) == (32.0, 1.0)
    assert config.rope_theta == 50000.0
    assert results["tp1"]["stats"]["compiles_after_warmup"] == 0
