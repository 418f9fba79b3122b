# SPDX-License-Identifier: Apache-2.0
"""Requests that used to compile after warm-up, or kill the engine, on the real engine under
VLLM_XLA_STRICT_COMPILE=1: every prompt_logprobs width is served by the warmed program (values
checked against transformers), a logit_bias wider than the sampler's sparse list is refused by
name and the engine serves on, and a metrics file that cannot be written does not stop it.

Besides the runner's own counter, JAX's lowering events are counted while serving (the engine
runs in this process): a program built outside the runner's registry shows there too."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time

import jax
import numpy as np
import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

import plugin_shim.worker
from tests.tiny_models import save_tiny_llama
from tpu_platform.sampling import MAX_SPARSE_ENTRIES

pytestmark = pytest.mark.slow  # builds vllm.LLM

VOCAB = 8192  # wider than the sparse list, so a request can bring more logit_bias entries
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # JAX lowered a new program


@dataclasses.dataclass
class Engine:
    llm: LLM
    hf_model: torch.nn.Module
    warm: dict[str, float]  # runner counters right after warm-up
    metrics_log: list[str]
    lowered: list[str]  # JAX lowering events since warm-up

    def assert_nothing_built_since_warm_up(self) -> None:
        stats = self.llm.collective_rpc("runner_stats")[0]
        assert stats["compiles_after_warmup"] == 0 and stats["compiles"] == self.warm["compiles"]
        assert self.lowered == []


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("warm_up_coverage")
    model_dir = save_tiny_llama(str(root / "model"), seed=3, vocab_size=VOCAB, max_position_embeddings=128)
    taken = root / "metrics-target"
    taken.mkdir()  # a directory where the snapshot goes: every write fails, as on a full disk
    with pytest.MonkeyPatch.context() as patch, _log_lines("vllm_xla.tpu_platform.metrics_file") as lines:
        patch.setenv("VLLM_XLA_STRICT_COMPILE", "1")
        patch.setattr(plugin_shim.worker, "metrics_path", lambda *args: str(taken))
        # 32 tokens a step: long prompts come in chunks, their prompt logprobs over several steps.
        llm = LLM(
            model=model_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
            block_size=16, seed=0,
        )  # fmt: skip
        warm = llm.collective_rpc("runner_stats")[0]
        lowered = []

        def on_duration(event: str, duration: float, **kwargs) -> None:
            if event == LOWERING_EVENT:
                lowered.append(event)

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            yield Engine(llm, LlamaForCausalLM.from_pretrained(model_dir).eval(), warm, lines, lowered)
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
            del llm
            gc.collect()


def _hf_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def test_every_prompt_logprobs_width_is_served_by_the_warmed_program(engine):
    rng = np.random.default_rng(0)
    lengths = [5, 70, 12, 41, 3, 33, 90, 2]
    prompts = [[1, *rng.integers(3, 384, n - 1).tolist()] for n in lengths]
    widths = [i % 6 for i in range(len(prompts))]  # 0..5, cycled
    params = [
        SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=n, detokenize=False) for n in widths
    ]
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    # One at a time too: steps whose only request wants prompt logprobs.
    outputs += engine.llm.generate([TokensPrompt(prompt_token_ids=prompts[1])], params[1], use_tqdm=False)
    for ids, n, output in zip([*prompts, prompts[1]], [*widths, widths[1]], outputs, strict=True):
        reference = _hf_logprobs(engine.hf_model, ids)
        positions = output.prompt_logprobs
        assert positions[0] is None and len(positions) == len(ids)
        for j, got in enumerate(positions[1:]):
            expected, target = reference[j], ids[j + 1]
            assert target in got
            assert abs(got[target].logprob - expected[target]) < 1e-3
            near = expected[target] + np.array([1e-4, -1e-4])  # a near tie may fall either way
            assert np.sum(expected >= near[0]) <= got[target].rank <= np.sum(expected >= near[1])
            assert len(got) in (n, n + 1)  # n when the prompt token is among the top n
            nth = np.sort(expected)[::-1][n - 1] if n else np.inf
            for token, value in got.items():
                assert abs(value.logprob - expected[token]) < 1e-3
                if token != target:
                    assert expected[token] >= nth - 1e-3  # among the top n
    engine.assert_nothing_built_since_warm_up()


def _greedy_with_bias(model, prompt: list[int], bias: dict[int, float], steps: int) -> list[int]:
    ids, add = list(prompt), np.zeros(VOCAB)
    add[list(bias)] = list(bias.values())
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
        ids.append(int(np.argmax(logits + add)))
    return ids[len(prompt) :]


def test_logit_bias_wider_than_the_sparse_list_is_refused_by_name(engine):
    prompt = [1, 20, 30, 40, 50]
    too_many = {t: -5.0 for t in range(MAX_SPARSE_ENTRIES + 904)}  # 5000 entries
    with pytest.raises(ValueError, match=f"logit_bias has 5000 entries.*limit of {MAX_SPARSE_ENTRIES}"):
        engine.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=4, logit_bias=too_many)
        )
    stops = list(range(3, MAX_SPARSE_ENTRIES + 4))  # held back by min_tokens: as many entries
    with pytest.raises(ValueError, match=f"{len(stops)} stop ids held back by min_tokens"):
        engine.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)],
            SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=stops),
        )
    # The widest list served: the greedy tokens pushed down, others pulled up, as NumPy does it.
    plain = _greedy_with_bias(engine.hf_model, prompt, {}, 6)
    rng = np.random.default_rng(1)
    chosen = rng.permutation(VOCAB)[:MAX_SPARSE_ENTRIES]
    bias = dict(zip(chosen.tolist(), rng.normal(0, 4, chosen.size).tolist(), strict=True))
    bias.update({t: -100.0 for t in plain})
    while len(bias) > MAX_SPARSE_ENTRIES:
        bias.pop(next(t for t in bias if t not in plain))
    params = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=bias, ignore_eos=True, detokenize=False)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    expected = _greedy_with_bias(engine.hf_model, prompt, bias, 6)
    assert list(out.outputs[0].token_ids) == expected and not set(expected) & set(plain)
    engine.assert_nothing_built_since_warm_up()


def test_a_metrics_file_that_cannot_be_written_does_not_stop_the_engine(engine):
    time.sleep(1.1)  # past the publishing interval: the next step tries again
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=[1, 7, 9])], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _greedy_with_bias(engine.hf_model, [1, 7, 9], {}, 8)
    failed = engine.llm.collective_rpc(lambda worker: worker.metrics.failed_writes)[0]
    assert failed >= 2
    assert len(engine.metrics_log) == 1 and "cannot publish the runner's counters" in engine.metrics_log[0]


@contextlib.contextmanager
def _log_lines(name: str):
    """The formatted messages `name`'s logger emits."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
