# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism through `vllm.LLM` on 8 simulated CPU devices.

The engines run in a subprocess per attention backend, each of the run's models in turn
(`tensor_parallel_engine`: the device count is fixed when JAX starts, and this process keeps one
device; one process a backend spares each model a start of vLLM and JAX). Greedy tokens at every TP size equal
transformers' fp32 greedy continuation; logprobs agree within 1e-3. Every parameter's actual
sharding is the rules table's, and each device holds 1/N of a split weight and of the KV cache.
One TP=4 engine serves, under VLLM_XLA_STRICT_COMPILE=1, a mixed workload with chunked prefill,
prefix-cache hits and preemption before its greedy check. Qwen3-MoE runs with
`enable_expert_parallel=True`: its experts placed by index, whole. Qwen3-Next (hybrid: Gated
DeltaNet beside gated attention) at TP=2 equals transformers with its prompts prefilled in
chunks, its state pools split with the key heads.

`make test` runs each family at one sharded size (TP=2; Qwen3-MoE at EP=4, whose attention also
repeats KV heads, on the `xla` backend; Llama at TP=4 only, its strict-compile workload on the
native kernel). The rest of the grid (`MORE_RUNS`: TP=1, where each family's own engine test
already compares with transformers, and the other sizes), the families whose paths others take
(`REPEATS`) and the sharded engines' equality with the one-device engine are `make test-full`'s.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
from vllm import LLM

from models.sharding import parameter_spec, rule_spec
from tests.models.tiny_checkpoints import hf_logits, prompts, save_tiny
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.plugin_shim.tensor_parallel_engine import environment
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # engines on simulated multi-device hosts

NEW_TOKENS = 6
LOGPROB_ATOL = 1e-3
# An 8-token step budget keeps warm-up to a few programs and prefills in chunks.
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, seed=0)
LENGTHS = [5, 13, 2]


def _greedy_run(tp: int, **llm) -> dict:
    return {"tp": tp, "prompts": prompts(LENGTHS, seed=3), "new_tokens": NEW_TOKENS, "llm": {**ENGINE, **llm}}


def _features_run(tp: int) -> dict:
    """Shared 40-token prefixes (prefix-cache hits), prompts longer than a step (chunked
    prefill) and 9 pages of 16 tokens for four sequences (preemption); a mixed sampling
    workload runs first, then the greedy check on the same engine."""
    prefix = prompts([40], seed=7)[0]
    tails = prompts([3, 9, 6, 12], seed=8)
    return {
        "tp": tp,
        "prompts": [prefix + t[1:] for t in tails],
        "new_tokens": NEW_TOKENS,
        "mixed": True,
        "llm": {**ENGINE, "block_size": 16, "num_gpu_blocks_override": 9, "enable_prefix_caching": True},
    }


def _run_engines(tmp_path, model: str, runs: list[dict], backend: str) -> list[dict]:
    """`runs` of `model` (or of each run's own `model`) in one process on `backend`."""
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": model, "runs": runs}))
    env = {**environment(), "VLLM_XLA_ATTENTION_BACKEND": backend, "VLLM_XLA_STRICT_COMPILE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.tensor_parallel_engine", str(job), str(out)],
        env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(out.read_text())


def _hf_reference(architecture: str, path: str, ps: list[list[int]]) -> tuple[list, list]:
    """transformers' greedy continuation of each prompt and the chosen tokens' logprobs."""
    import torch
    import transformers

    hf = getattr(transformers, architecture).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    tokens, logprobs = [], []
    for p in ps:
        ids, lps = list(p), []
        for _ in range(NEW_TOKENS):
            logits = hf_logits(hf, ids)[-1].astype(np.float64)
            log_softmax = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
            ids.append(int(np.argmax(logits)))
            lps.append(float(log_softmax[ids[-1]]))
        tokens.append(ids[len(p) :])
        logprobs.append(lps)
    return tokens, logprobs


# model -> (architecture, checkpoint builder, engine runs in `make test`, attention backend).
# Llama has 8 query and 2 KV heads (TP 4 and 8 repeat KV heads), the tiny Qwen3, Gemma 2 and
# GPT-OSS have 4 and 2 (GPT-OSS: attention sinks split with the query heads, on the native kernel).
MODELS = {
    "llama": (
        "LlamaForCausalLM",
        lambda path: save_tiny_llama(
            path, seed=4, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2
        ),
        [_features_run(4)],
        "cpu_native",
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        functools.partial(save_tiny, "GptOssForCausalLM"),
        [_greedy_run(2)],
        "cpu_native",
    ),
    # Llama 4: chunked attention (chunks of 8 < the 13-token prompt) on the native kernel, a
    # shared expert beside the routed ones split on their intermediate size.
    "llama4": (
        "Llama4ForCausalLM",
        functools.partial(save_tiny, "Llama4ForCausalLM"),
        [_greedy_run(2)],
        "cpu_native",
    ),
    # Gemma 4: per-kind head dims and KV heads (the full layers' one KV head repeated on 2
    # devices), KV-shared layers, per-layer inputs; its own q/k/v projections, not fused.
    "gemma4": (
        "Gemma4ForCausalLM",
        functools.partial(save_tiny, "Gemma4ForCausalLM"),
        [_greedy_run(2)],
        "xla",
    ),
    # Qwen3-Next: Gated DeltaNet layers split by key heads (2, one a device), their states with them,
    # carried through the 8-token steps' chunked prefill; gated attention's fused q/gate/k/v blocks.
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        functools.partial(save_tiny_qwen3_next, seed=3),
        [_greedy_run(2)],
        "xla",
    ),
    # Qwen3-Next at TP=4: one key head (two value heads) a device, its 2 KV heads repeated to 4.
    "qwen3_next_tp4": (
        "Qwen3NextForCausalLM",
        functools.partial(save_tiny_qwen3_next, seed=3, linear_num_key_heads=4, linear_num_value_heads=8),
        [_greedy_run(4)],
        "xla",
    ),
    # Qwen3-MoE under expert parallelism: 8 experts, 2 whole ones a device at EP=4 (4 at EP=2);
    # its dense layer and attention tensor-parallel, its 2 KV heads repeated at 4 devices.
    "qwen3_moe_ep": (
        "Qwen3MoeForCausalLM",
        functools.partial(save_tiny, "Qwen3MoeForCausalLM"),
        [_greedy_run(4, enable_expert_parallel=True)],
        "xla",
    ),
    **{
        name: (architecture, functools.partial(save_tiny, architecture), [_greedy_run(2)], "xla")
        for name, architecture in (
            ("qwen3", "Qwen3ForCausalLM"),
            ("gemma2", "Gemma2ForCausalLM"),
            ("mixtral", "MixtralForCausalLM"),
        )
    },
}

# The rest of the grid (`make test-full`): the one-device engine (each family's own engine test
# compares TP=1 with transformers in `make test`) and sizes repeating the paths above.
MORE_RUNS = {
    "llama": [_greedy_run(1), _greedy_run(8), _greedy_run(2)],
    "gpt_oss": [_greedy_run(1)],
    "llama4": [_greedy_run(1)],
    "qwen3_next": [_greedy_run(1)],
    "qwen3_moe_ep": [_greedy_run(2, enable_expert_parallel=True)],
    "qwen3": [_greedy_run(4)],
    "gemma2": [_greedy_run(4)],
    "mixtral": [_greedy_run(4)],
}

# Runs that repeat, on another architecture, paths the others take (`make test-full`): Qwen3's
# attention, q/k norms included, is Qwen3-MoE's (split by heads beside its experts) and its MLP
# is Llama's; Qwen3-Next at TP=4 is its TP=2 run on more devices (the model alone is checked at
# TP=4 in `make test`: tests/models/test_qwen3_next_on_mesh.py); Mixtral's experts split inside
# each expert as GPT-OSS's, Llama 4's and Qwen3-Next's are, and Mixtral at TP=2 answers with
# transformers' greedy tokens through the server in make test (test_data_parallel.py); Gemma 2's
# layers split by Llama's rules (q/k/v and gate/up by columns, o and down by rows), its windows
# and soft caps computed per device on its own heads as at TP=1.
REPEATS = ("qwen3", "qwen3_next_tp4", "mixtral", "gemma2")
CASES = [
    pytest.param(name, False, id=name, marks=[pytest.mark.full] if name in REPEATS else [])
    for name in sorted(MODELS)
] + [pytest.param(name, True, id=f"{name}-more", marks=pytest.mark.full) for name in sorted(MORE_RUNS)]
# The placement check skips TP=1 runs: cases holding only those have nothing to check.
SHARDED_CASES = [c for c in CASES if not c.values[1] or any(r["tp"] > 1 for r in MORE_RUNS[c.values[0]])]


class _Served:
    """Each model's engine runs and their HF references; the checkpoint is built once a model.
    On first use the runs of every case this session selected (`wanted`) on the same attention
    backend run together, one subprocess for all of them."""

    def __init__(self, tmp_path_factory, wanted: set[tuple[str, bool]]):
        self._tmp = tmp_path_factory
        self._wanted = wanted
        self._models: dict[str, tuple] = {}
        self._done: dict[tuple[str, bool], tuple] = {}

    def _model(self, name: str) -> tuple:
        if name not in self._models:
            tmp = self._tmp.mktemp(name)
            self._models[name] = (tmp, MODELS[name][1](str(tmp / "model")))
        return self._models[name]

    def _runs(self, name: str, more: bool) -> list[dict]:
        return MORE_RUNS[name] if more else MODELS[name][2]

    def __call__(self, name: str, more: bool = False) -> tuple[list[dict], list[dict], list[tuple]]:
        if (name, more) not in self._done:
            backend = MODELS[name][3]
            others = self._wanted - {(name, more)} - set(self._done)
            cases = [(name, more), *sorted(case for case in others if MODELS[case[0]][3] == backend)]
            jobs = [{**run, "model": self._model(n)[1]} for n, m in cases for run in self._runs(n, m)]
            work = self._tmp.mktemp(f"{backend}_runs")
            results = iter(_run_engines(work, "", jobs, backend))
            for n, m in cases:
                runs = self._runs(n, m)
                path = self._model(n)[1]
                references = [_hf_reference(MODELS[n][0], path, run["prompts"]) for run in runs]
                self._done[(n, m)] = (runs, [next(results) for _ in runs], references)
        return self._done[(name, more)]


def _case(item: pytest.Item) -> tuple[str, bool] | None:
    """The (model, tier) case a test item of this module asks for by its parameters, if any."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return (params["name"], params["more"]) if "more" in params else None


@pytest.fixture(scope="module")
def served(request, tmp_path_factory) -> _Served:
    here = request.node.path
    wanted = {_case(item) for item in request.session.items if item.path == here} - {None}
    return _Served(tmp_path_factory, wanted)


@pytest.mark.parametrize(("name", "more"), CASES)
def test_greedy_tokens_and_logprobs_match_transformers_at_every_tp_size(served, name, more):
    runs, results, references = served(name, more)
    for run, result, (tokens, logprobs) in zip(runs, results, references, strict=True):
        assert result["tokens"] == tokens, f"TP={run['tp']}"
        np.testing.assert_allclose(
            np.asarray(result["logprobs"]), np.asarray(logprobs), atol=LOGPROB_ATOL, err_msg=f"TP={run['tp']}"
        )


@pytest.mark.full
@pytest.mark.parametrize(("name", "sharded"), [("llama", 2), ("qwen3_next", 1)])
def test_sharded_engines_equal_the_one_device_engine(served, name, sharded):
    """The TP=1 engine against the sharded ones (Llama's TP=2 and TP=8, Qwen3-Next's TP=2;
    transformers is every model's reference)."""
    (more_runs, more_results, _), (runs, results, _) = served(name, True), served(name, False)
    assert more_runs[0]["tp"] == 1
    compared = 0
    for run, result in zip(more_runs[1:] + runs, more_results[1:] + results, strict=True):
        if run["prompts"] == more_runs[0]["prompts"]:
            assert result["tokens"] == more_results[0]["tokens"], f"TP={run['tp']}"
            np.testing.assert_allclose(result["logprobs"], more_results[0]["logprobs"], atol=LOGPROB_ATOL)
            compared += 1
    assert compared == sharded


def _normalized(spec: list) -> list:
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


@pytest.mark.parametrize(("name", "more"), SHARDED_CASES)
def test_every_parameter_is_placed_as_the_rules_table_says(served, name, more):
    runs, results, _ = served(name, more)
    for run, result in zip(runs, results, strict=True):
        tp = run["tp"]
        if tp == 1:
            continue
        split = set()
        for path, placed in result["params"].items():
            expert_parallel = run["llm"].get("enable_expert_parallel", False)
            expected = parameter_spec(path, tuple(placed["shape"]), tp, expert_parallel=expert_parallel)
            assert _normalized(placed["spec"]) == _normalized(list(expected)), path
            assert placed["devices"] == tp, path
            if any(expected):
                assert placed["device_bytes"] == [placed["bytes"] // tp] * tp, path
                split.add(path)
            else:
                assert placed["device_bytes"] == [placed["bytes"]] * tp, path
        # The table's split rules are in use (the tiny vocabularies divide by 8).
        attention = "q_proj.kernel" if name == "gemma4" else "qkv_proj.kernel"  # Qwen3-Next's with its gates
        kinds = [attention, "o_proj.kernel", "embed_tokens.embedding"]
        kinds += {
            "mixtral": ["experts.gate_proj.kernel", "experts.down_proj.kernel"],
            "qwen3_moe_ep": ["experts.gate_proj.kernel", "experts.down_proj.kernel", "gate_up_proj.kernel"],
            "gpt_oss": ["experts.gate_up_proj", "experts.down_proj", "self_attn.sinks"],
            "llama4": [
                "experts.gate_proj.kernel",
                "experts.down_proj.kernel",
                "shared_expert.gate_up_proj.kernel",
            ],
            "qwen3_next": [
                "experts.gate_proj.kernel",
                "shared_expert.gate_up_proj.kernel",
                "linear_attn.in_proj_qkvz.kernel",
                "linear_attn.in_proj_ba.kernel",
                "linear_attn.out_proj.kernel",
                "linear_attn.A_log",
            ],
        }.get(name, ["gate_up_proj.kernel", "down_proj.kernel"])
        for kind in kinds:
            assert any(path.endswith(kind) and any(rule_spec(path)) for path in split), (name, tp, kind)
        for cache in result["caches"]:
            assert cache["device_bytes"] == [cache["bytes"] // tp] * tp


def test_tp4_serves_chunked_prefill_prefix_hits_and_preemption_without_compiling(served):
    runs, results, _ = served("llama")
    (stats,) = [r["stats"] for run, r in zip(runs, results, strict=True) if run.get("mixed")]
    (warm,) = [r["warm"] for run, r in zip(runs, results, strict=True) if run.get("mixed")]
    assert stats["compiles_after_warmup"] == 0 and stats["compiles"] == warm["compiles"]
    assert stats["partial_prefill_steps"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["preempted_requests"] > 0 and stats["resumed_requests"] > 0


@pytest.mark.parametrize(
    ("checkpoint", "options", "message"),
    [
        (
            {},
            dict(tensor_parallel_size=3),
            r"attention heads \(4\) must be divisible by tensor parallel size \(3\)",
        ),
        (
            dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192),
            dict(tensor_parallel_size=2),
            r"tensor_parallel_size=2 cannot shard this model: its 3 KV heads .* one of \[1, 3, 6\]",
        ),
        (
            dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=320),
            dict(tensor_parallel_size=6),
            r"tensor_parallel_size=6 cannot shard this model: its intermediate_size \(320\) does not "
            r"divide by 6; use --tensor-parallel-size one of \[1, 2\]",
        ),
        (
            {},
            dict(pipeline_parallel_size=2),
            r"pipeline_parallel_size \(pipeline parallelism\) is not supported",
        ),
        ({}, dict(tensor_parallel_size=2), "needs 2 devices, but this host has 1 cpu device"),
    ],
)
def test_impossible_configurations_are_refused_by_name(tmp_path_factory, checkpoint, options, message):
    path = save_tiny_llama(str(tmp_path_factory.mktemp("refused") / "model"), **checkpoint)
    with pytest.raises(Exception, match=message):
        LLM(model=path, **ENGINE, **options)
