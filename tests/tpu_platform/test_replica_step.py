# SPDX-License-Identifier: Apache-2.0
"""Data-parallel replicas in one step program (`tpu_platform.replica_step`), with the experts
split by index over them (expert parallelism across replicas, attention data-parallel).

On 4 simulated CPU devices (`replica_step_worker.py`, a process of its own): 2 and 4 replicas
of a tiny Qwen3-MoE, each with its own batch and KV cache, give each batch's logits, hidden
states, greedy tokens and written cache as that batch run alone on one device (itself checked
against transformers in `tests/models/test_architectures.py`); each device holds E / D experts;
the step exchanges only the experts' gather of every replica's tokens and the scatter of their
sums, and nothing at all when each replica holds every expert. Hand-worked cases pin the
placement helpers and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from models.sharding import DATA_AXIS, MODEL_AXIS, check_expert_parallel
from tests.models.tiny_checkpoints import save_tiny
from tests.xla_flags import with_host_devices
from tpu_platform.lora_slots import LoraConfig
from tpu_platform.replica_step import (
    agreed_tokens,
    fewest,
    num_replicas,
    over_replicas_step,
    replica_mesh,
)
from tpu_platform.runner_config import RunnerConfig

NUM_EXPERTS, MOE_LAYERS = 8, 2  # the tiny Qwen3-MoE's (layer 1 is a dense MLP)
STEP_TOKENS = 16  # the worker's padded step


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    path = save_tiny("Qwen3MoeForCausalLM", str(tmp_path_factory.mktemp("replicas") / "model"), seed=2)
    env = {**os.environ, "XLA_FLAGS": with_host_devices(4), "JAX_PLATFORMS": "cpu"}
    worker = [sys.executable, "-m", "tests.tpu_platform.replica_step_worker", path]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("REPORT ", 1)[1])


FORMS = [("dp2_ep", 2, True), ("dp4_ep", 4, True), ("dp2", 2, False)]


@pytest.mark.slow
@pytest.mark.parametrize(("form", "replicas", "expert_parallel"), FORMS)
def test_each_replica_computes_its_own_batch_as_one_device_does(report, form, replicas, expert_parallel):
    got = report[form]
    assert got["max_diff"] <= 1e-5 * report["scale"], got["max_diff"]
    assert got["greedy"] == got["greedy_alone"]
    assert len({tuple(tokens) for tokens in got["greedy"]}) == replicas  # the batches differ
    assert got["cache_scale"] > 0 and got["cache_diff"] <= 1e-5 * got["cache_scale"]


@pytest.mark.slow
@pytest.mark.parametrize(("form", "replicas", "expert_parallel"), FORMS)
def test_each_device_holds_its_share_of_the_experts(report, form, replicas, expert_parallel):
    experts = report[form]["experts"]
    assert len(experts) == 3 * MOE_LAYERS  # gate, up, down of each MoE layer
    share = NUM_EXPERTS // replicas if expert_parallel else NUM_EXPERTS
    for name, (whole, local) in experts.items():
        assert whole[0] == NUM_EXPERTS and local == [share, *whole[1:]], name


@pytest.mark.slow
@pytest.mark.parametrize(("form", "replicas", "expert_parallel"), FORMS)
def test_replicas_exchange_only_the_experts_tokens_and_sums(report, form, replicas, expert_parallel):
    hidden = report["tokens_by_hidden"][1]
    kinds = [(kind, shapes) for kind, shapes in report[form]["collectives"]]
    if not expert_parallel:
        assert kinds == []  # each replica's step on its own device: nothing crosses replicas
        return
    gathered = replicas * STEP_TOKENS
    assert sorted(kinds) == sorted(
        [("all-gather", [[gathered, hidden]]), ("reduce-scatter", [[STEP_TOKENS, hidden]])] * MOE_LAYERS
        + [("all-gather", [[gathered, 2]])] * 2 * MOE_LAYERS  # the routing weights and expert ids (top 2)
    )


def test_replica_mesh_is_a_device_a_replica_and_needs_the_devices():
    mesh = replica_mesh(1)
    assert dict(mesh.shape) == {DATA_AXIS: 1, MODEL_AXIS: 1} and num_replicas(mesh) == 1
    assert num_replicas(None) == 1
    with pytest.raises(ValueError, match="needs 9 devices"):
        replica_mesh(9, jax.devices()[:1])
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        replica_mesh(0)


def test_replicas_of_several_devices_each_are_refused_by_name():
    mesh = AbstractMesh((2, 2), (DATA_AXIS, MODEL_AXIS))
    with pytest.raises(ValueError, match=r"replicas of 2 devices each .* use one device a replica"):
        over_replicas_step(lambda *a, **k: a, mesh, [], [], 0)


def test_experts_that_do_not_split_over_the_replicas_name_the_sizes_that_do():
    check_expert_parallel(np.int64(8), 4, replicas=4)
    with pytest.raises(
        ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=1 .* one of \[1, 2, 4, 8\]"
    ):
        check_expert_parallel(8, 3, replicas=3)


def test_one_process_agrees_with_itself():
    # The ranks' agreements are gathers over the job; alone, each is this process's own value
    # (the two-rank case runs through vLLM's server: tests/plugin_shim/test_data_parallel_experts.py).
    assert agreed_tokens(5) == 5 and fewest(7) == 7


def test_a_runner_of_replicas_in_one_program_takes_one_device_each_and_the_experts_over_them():
    with pytest.raises(ValueError, match="take expert parallelism and one device a replica"):
        RunnerConfig(model_path="m", data_parallel_size=2)
    with pytest.raises(ValueError, match="take expert parallelism and one device a replica"):
        RunnerConfig(model_path="m", data_parallel_size=2, expert_parallel=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="lora is not served with the experts split over data-parallel"):
        RunnerConfig(model_path="m", data_parallel_size=2, expert_parallel=True, lora=LoraConfig(1, 8))
    RunnerConfig(model_path="m", data_parallel_size=2, expert_parallel=True)
