# SPDX-License-Identifier: Apache-2.0
"""One request driven through a runner with speculation (no vLLM), as the proposer tests drive it:
a prompt prefilled in two chunks, then verification steps whose drafts are the proposer's own or
drafts made to keep a given number of the target's greedy tokens. Records every step's output
beside the target's greedy tokens (transformers) and every step's drafts beside the independent
reference's, for the test to compare."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tests.greedy_reference import hf_greedy
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.sampling import SamplingOptions
from tpu_platform.speculation import SpeculationConfig
from tpu_platform.step_update import CachedRequest, CachedRequests, NewRequest, StepUpdate

PROMPT_LEN = 20
CHUNK = 12  # the prompt's first prefill chunk; the rest is the second


def speculating_runner(
    target: str,
    method: str,
    drafter: str,
    k: int,
    *,
    num_pages: int = 8,
    layout: Callable[[Runner], object] | None = None,
    **fields,
) -> Runner:
    """A runner of the checkpoint `target` proposing `k` drafts a step with `method` from
    `drafter`, loaded, its cache of `num_pages` pages (in the groups `layout(runner)` gives once the
    model is loaded) allocated and its
    programs for the driven steps' shapes warmed up; `fields`: more `RunnerConfig` fields."""
    config = dict(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, page_size=16,
                  native_dense=False, strict_compile=True) | fields  # fmt: skip
    speculation = SpeculationConfig(num_tokens=k, method=method, draft_model=drafter)
    runner = Runner(RunnerConfig(model_path=target, speculation=speculation, **config))
    runner.load_model()
    groups = {} if layout is None else {"layout": layout(runner)}
    runner.initialize_kv_cache(num_pages=num_pages, **groups)
    runner.warm_up(sorted({runner.buckets.shape_for(n, 1) for n in (CHUNK, PROMPT_LEN - CHUNK, 1 + k)}))
    return runner


def step(runner: Runner, num_tokens: int, *, new=None, computed=0, outputs=0, drafts=None) -> tuple:
    """One step of request "a" (`new` the first time); its sampled tokens and next drafts."""
    cached = [] if new else [CachedRequest("a", None, False, computed, outputs)]
    runner.execute(
        StepUpdate(
            new_requests=[new] if new else [],
            cached=CachedRequests.of(cached),
            finished_req_ids=set(),
            num_scheduled_tokens={"a": num_tokens},
            spec_tokens={"a": drafts} if drafts else {},
        )
    )
    result = runner.sample()
    proposed = runner.speculation.propose(runner.table, result.req_ids, result.sampled_token_ids)
    return result.sampled_token_ids[0], proposed[0]


def drive(
    runner: Runner,
    target,
    reference: Callable[[list[int]], list[int]],
    prompt: list[int],
    k: int,
    *,
    keeps: Sequence[int | None],
    vocab: int,
    blocks: list[list[int]] | None = None,
) -> dict:
    """Request "a" of `prompt` (its pages `blocks` a KV-cache group) in two chunks, then a
    verification step for each of `keeps`: None verifies the proposer's own drafts, n drafts
    made to keep n of the target's greedy tokens (the rest off by one id). `reference(history)`:
    the independent reference's drafts. Returns the first chunk's output and drafts
    (`partial`), each later step's output and the target's greedy tokens, its drafts and the
    reference's."""
    new = NewRequest("a", prompt, blocks or [[1, 2, 3, 4]], 0, SamplingOptions(temperature=0.0))
    record = {"partial": step(runner, CHUNK, new=new), "outputs": [], "greedy": [], "drafts": []}
    record["reference_drafts"] = []
    out, drafts = step(runner, len(prompt) - CHUNK, computed=CHUNK)
    history = [*prompt, *out]
    record["outputs"].append(out)
    record["greedy"].append(hf_greedy(target, prompt, 1))
    for keep in keeps:
        record["drafts"].append(drafts)
        record["reference_drafts"].append(reference(history))
        expected = hf_greedy(target, history, k + 1)
        if keep is not None:
            drafts = [*expected[:keep], *[(t + 1) % vocab for t in expected[keep:k]]]
        kept = next((i for i in range(k) if drafts[i] != expected[i]), k)
        computed, outputs = len(history) - 1, len(history) - len(prompt)
        out, drafts = step(runner, 1 + k, computed=computed, outputs=outputs, drafts=drafts)
        record["outputs"].append(out)
        record["greedy"].append(expected[: kept + 1])
        history += out
    record["drafts"].append(drafts)
    record["reference_drafts"].append(reference(history))
    return record


def assert_verified_like_reference(
    runner: Runner,
    target,
    reference: Callable[[list[int]], list[int]],
    prompt: list[int],
    k: int,
    *,
    keeps: Sequence[int | None],
    vocab: int,
    blocks: list[list[int]] | None = None,
) -> None:
    """`drive`s request "a" (the same arguments) and asserts what every proposer must do: the
    partial prefill chunk samples and drafts nothing (the drafter's pass only), every later step
    gives the target's greedy tokens however many drafts it kept, the proposer's drafts are the
    reference's, and nothing compiled after warm-up."""
    record = drive(runner, target, reference, prompt, k, keeps=keeps, vocab=vocab, blocks=blocks)
    assert record["partial"] == ([], [])
    assert record["outputs"] == record["greedy"]
    assert record["drafts"] == record["reference_drafts"]
    assert runner.programs.compiles_after_warmup == 0
