# SPDX-License-Identifier: Apache-2.0
"""The prompt-logprobs program: one shape whatever the step, every width up to the warmed one
served by it without a compile, long prompts in several calls, values against NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpu_platform.programs import Programs
from tpu_platform.prompt_logprobs import PromptLogprobs, PromptLogprobsProgram, PromptLogprobsShape

HIDDEN, VOCAB = 8, 50


class _Head(nnx.Module):
    """The one method the program calls: `compute_logits(hidden[R, D]) -> [R, V]`."""

    def __init__(self):
        self.weight = nnx.Param(
            jnp.asarray(np.random.default_rng(0).normal(0, 1, (HIDDEN, VOCAB)), jnp.float32)
        )

    def compute_logits(self, hidden):
        return hidden @ self.weight[...]


def _warmed(max_logprobs: int, rows: int = 4) -> tuple[PromptLogprobsProgram, Programs, nnx.State]:
    graphdef, state = nnx.split(_Head())
    shape = PromptLogprobsShape.for_engine(
        max_num_batched_tokens=rows,
        hidden_size=HIDDEN,
        dtype=np.float32,
        vocab_size=VOCAB,
        max_logprobs=max_logprobs,
    )
    program = PromptLogprobsProgram(graphdef, shape, sharding=None, context="test head")
    programs = Programs(strict=True, cache=None)
    programs.build_all(program.warm_up_specs(state), workers=1)
    programs.seal()
    return program, programs, state


def _reference(hidden: np.ndarray, targets: np.ndarray, state: nnx.State):
    logits = hidden.astype(np.float64) @ np.asarray(state["weight"][...], np.float64)
    top = logits.max(1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    return logprobs, logprobs[np.arange(len(targets)), targets]


def test_every_width_up_to_the_warmed_one_runs_without_a_compile():
    program, programs, state = _warmed(max_logprobs=5)
    rng = np.random.default_rng(1)
    hidden = rng.normal(0, 1, (10, HIDDEN)).astype(np.float32)  # 10 rows: three calls of 4
    targets = rng.integers(0, VOCAB, 10).astype(np.int32)
    expected, expected_target = _reference(hidden, targets, state)
    for wanted in range(6):
        ids, logprobs, ranks = program.run(programs, state, hidden, targets, wanted)
        assert ids.shape == logprobs.shape == (10, 6) and ranks.shape == (10,)
        np.testing.assert_array_equal(ids[:, 0], targets)
        np.testing.assert_allclose(logprobs[:, 0], expected_target, atol=1e-4)
        np.testing.assert_array_equal(ids[:, 1:], np.argsort(-expected, axis=1, kind="stable")[:, :5])
        np.testing.assert_array_equal(ranks, (expected >= expected_target[:, None] - 1e-6).sum(1))
    assert programs.count == 1 and programs.compiles_after_warmup == 0


def test_without_a_finite_max_logprobs_a_new_width_is_a_counted_compile():
    program, programs, state = _warmed(max_logprobs=-1)
    assert programs.count == 0  # nothing to warm: the width follows the request
    hidden, targets = np.zeros((3, HIDDEN), np.float32), np.zeros(3, np.int32)
    with pytest.raises(RuntimeError, match=r"a program was built after warm-up for .*prompt_logprobs"):
        program.run(programs, state, hidden, targets, 3)


def test_collect_fills_each_request_chunk_by_chunk():
    """Two requests over two steps; the rows handed to the program are exactly their prompt
    positions, each with its next prompt token."""

    class Table:
        num_computed = np.array([0, 0])
        num_prompt_tokens = np.array([5, 3])
        token_ids = np.array([[10, 11, 12, 13, 14, 0], [20, 21, 22, 0, 0, 0]])

    calls = []

    def compute(hidden, targets, width):
        calls.append((hidden[:, 0].tolist(), targets.tolist(), width))
        n = len(targets)
        ids = np.tile(targets[:, None], (1, width + 1))
        return ids, np.zeros((n, width + 1), np.float32), np.arange(n, dtype=np.int32)

    tracker = PromptLogprobs(VOCAB)
    tracker.add("a", 2)
    tracker.add("b", 0)
    hidden = np.arange(8, dtype=np.float32)[:, None] * np.ones((1, HIDDEN), np.float32)
    # Step 1: "a" prefills 3 of its 5 tokens (rows 0-2), "b" its whole prompt (rows 3-5).
    done = tracker.collect(compute, hidden, Table, ["a", "b"], np.array([0, 1]), np.array([0, 3, 6]))
    assert calls[-1] == ([0.0, 1.0, 2.0, 3.0, 4.0], [11, 12, 13, 21, 22], 2)
    assert list(done) == ["b"] and done["b"][0].tolist() == [[21], [22]]
    # Step 2: "a" prefills its last 2 tokens (rows 0-1); only the first has a next prompt token.
    Table.num_computed = np.array([3, 3])
    done = tracker.collect(compute, hidden, Table, ["a"], np.array([0]), np.array([0, 2]))
    assert calls[-1] == ([0.0], [14], 2)
    assert done["a"][0][:, 0].tolist() == [11, 12, 13, 14] and done["a"][0].shape == (4, 3)
    assert not tracker.wanted_in(["a", "b"])
