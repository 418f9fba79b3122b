# SPDX-License-Identifier: Apache-2.0
"""The runner as a pooling runner, with JAX alone (no vLLM): two prompts in one step, one of them
over two steps, mean pooling and a Matryoshka width, against transformers' hidden states."""

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from tests.models.tiny_checkpoints import prompts
from tests.tiny_models import save_tiny_llama
from tpu_platform.pooling import PoolingConfig, PoolingOptions
from tpu_platform.runner import Runner, RunnerConfig
from tpu_platform.sampling import SamplingOptions
from tpu_platform.step_update import CachedRequest, CachedRequests, NewRequest, StepUpdate

ATOL = 1e-4
GREEDY = SamplingOptions(temperature=0.0)
STEPS = [(32, 2), (13, 1), (29, 2)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("pool_runner")), seed=6)


def _runner(path: str, method: str) -> Runner:
    runner = Runner(
        RunnerConfig(
            model_path=path, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, page_size=16,
            native_dense=False, pooling=PoolingConfig(task="embed", method=method),
        )
    )  # fmt: skip
    runner.load_model()
    runner.initialize_kv_cache(num_pages=16)
    # The step shapes these tests make (tokens, sequences), not every bucket: a faster start.
    runner.warm_up(list(dict.fromkeys(runner.buckets.shape_for(t, r) for t, r in STEPS)))
    return runner


def _hidden(path: str, ids: list[int]) -> np.ndarray:
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].numpy()


def test_last_token_over_two_steps_and_a_truncated_row(tiny_dir):
    runner = _runner(tiny_dir, "LAST")
    short, long = prompts([5, 40], seed=3)
    runner.execute(
        StepUpdate(
            new_requests=[
                NewRequest("short", short, [[0]], 0, GREEDY, pooling=PoolingOptions(dimensions=8)),
                NewRequest("long", long, [[1, 2, 3]], 0, GREEDY, pooling=PoolingOptions(activation=False)),
            ],
            cached=CachedRequests.of([]),
            finished_req_ids=set(),
            num_scheduled_tokens={"short": 5, "long": 27},  # 32 tokens: the long prompt's first chunk
        )
    )
    req_ids, rows = runner.pool()
    assert req_ids == ["short", "long"] and rows[1] is None  # a partial prefill chunk
    last = _hidden(tiny_dir, short)[-1][:8]
    np.testing.assert_allclose(rows[0], last / np.linalg.norm(last), atol=ATOL)
    runner.execute(
        StepUpdate(
            new_requests=[],
            cached=CachedRequests.of([CachedRequest("long", None, False, 27, 0)]),
            finished_req_ids={"short"},
            num_scheduled_tokens={"long": 13},
        )
    )
    req_ids, rows = runner.pool()
    assert req_ids == ["long"]
    np.testing.assert_allclose(rows[0], _hidden(tiny_dir, long)[-1], atol=ATOL)  # not normalized
    assert runner.programs.compiles_after_warmup == 0


def test_mean_of_each_prompt_in_one_step(tiny_dir):
    runner = _runner(tiny_dir, "MEAN")
    batch = prompts([9, 20], seed=4)
    runner.execute(
        StepUpdate(
            new_requests=[
                NewRequest(f"r{i}", ids, [[2 * i, 2 * i + 1]], 0, GREEDY, pooling=PoolingOptions())
                for i, ids in enumerate(batch)
            ],
            cached=CachedRequests.of([]),
            finished_req_ids=set(),
            num_scheduled_tokens={"r0": 9, "r1": 20},
        )
    )
    _, rows = runner.pool()
    for ids, row in zip(batch, rows, strict=True):
        mean = _hidden(tiny_dir, ids).mean(0)
        np.testing.assert_allclose(row, mean / np.linalg.norm(mean), atol=ATOL)
    assert runner.programs.compiles_after_warmup == 0
