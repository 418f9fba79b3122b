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

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from models.sharding import DATA_AXIS, MODEL_AXIS, check_expert_parallel
from tests.models.tiny_checkpoints import save_tiny
from tests.xla_flags import with_host_devices
from tpu_platform.lora_slots import LoraConfig
from tpu_platform.replica_step import (
    agreed_tokens,
    fewest,
    num_replicas,
    replica_mesh,
    replica_rows_spec,
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


# (form, replicas, devices a replica, experts split over the replicas)
FORMS = [("dp2_ep", 2, 1, True), ("dp4_ep", 4, 1, True), ("dp2", 2, 1, False), ("dp2_tp2_ep", 2, 2, True)]
ARGS = ("form", "replicas", "devices", "expert_parallel")


@pytest.mark.slow
@pytest.mark.parametrize(ARGS, FORMS)
def test_each_replica_computes_its_own_batch_as_one_device_does(
    report, form, replicas, devices, expert_parallel
):
    got = report[form]
    assert got["max_diff"] <= 1e-5 * report["scale"], got["max_diff"]
    assert got["greedy"] == got["greedy_alone"]
    assert len({tuple(tokens) for tokens in got["greedy"]}) == replicas  # the batches differ
    assert got["cache_scale"] > 0
    if devices == 1:  # split over a replica's devices, a cache has the tensor-parallel layout
        assert got["cache_diff"] <= 1e-5 * got["cache_scale"]


@pytest.mark.slow
@pytest.mark.parametrize(ARGS, FORMS)
def test_each_device_holds_its_share_of_the_experts(report, form, replicas, devices, expert_parallel):
    experts = report[form]["experts"]
    assert len(experts) == 3 * MOE_LAYERS  # gate, up, down of each MoE layer
    share = NUM_EXPERTS // (replicas * devices) if expert_parallel else NUM_EXPERTS
    for name, (whole, local) in experts.items():
        assert whole[0] == NUM_EXPERTS and local == [share, *whole[1:]], name


@pytest.mark.slow
@pytest.mark.parametrize(ARGS, FORMS)
def test_replicas_exchange_only_the_experts_tokens_and_sums(report, form, replicas, devices, expert_parallel):
    hidden = report["tokens_by_hidden"][1]
    kinds = [(kind, shapes) for kind, shapes in report[form]["collectives"]]
    if not expert_parallel:
        assert kinds == []  # each replica's step on its own device: nothing crosses replicas
        return
    gathered = replicas * STEP_TOKENS
    expected = [
        ("all-gather", [[gathered, hidden]]),
        ("reduce-scatter", [[STEP_TOKENS, hidden]]),
    ] * MOE_LAYERS
    expected += [("all-gather", [[gathered, 2]])] * 2 * MOE_LAYERS  # the routing weights and ids (top 2)
    if devices > 1:  # the gathered tokens' sums over the replica's devices, before the scatter
        expected += [("all-reduce", [[gathered, hidden]])] * MOE_LAYERS
    across = [
        (kind, shapes) for kind, shapes in kinds if shapes[0][0] == gathered or kind == "reduce-scatter"
    ]
    assert sorted(across) == sorted(expected)
    # The rest is tensor parallelism inside each replica: its own step's rows, no other replica's.
    inside = [shapes for kind, shapes in kinds if (kind, shapes) not in expected]
    assert (devices > 1) == bool(inside) and all(shapes[0][0] <= STEP_TOKENS for shapes in inside), inside


def test_replica_mesh_is_a_device_a_replica_and_needs_the_devices():
    mesh = replica_mesh(1)
    assert dict(mesh.shape) == {DATA_AXIS: 1, MODEL_AXIS: 1} and num_replicas(mesh) == 1
    assert num_replicas(None) == 1
    with pytest.raises(ValueError, match="needs 9 devices"):
        replica_mesh(9, jax.devices()[:1])
    with pytest.raises(ValueError, match="must be >= 1, got 0 and 1"):
        replica_mesh(0)


@dataclasses.dataclass(frozen=True)
class _Device:
    id: int


def test_replicas_of_several_devices_are_each_a_block_of_the_devices_and_split_their_caches():
    devices = [_Device(i) for i in range(8)]  # `replica_mesh` only lays them out
    mesh = replica_mesh(2, devices, devices_per_replica=3)
    assert dict(mesh.shape) == {DATA_AXIS: 2, MODEL_AXIS: 3}
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 2], [3, 4, 5]]
    # the replicas side by side on the first axis, each replica's split over its devices as its
    # own is: a cache on its KV heads (the xla layout's first axis: replica-major there), a
    # latent cache not at all
    assert replica_rows_spec(PartitionSpec(MODEL_AXIS)) == PartitionSpec((DATA_AXIS, MODEL_AXIS))
    assert replica_rows_spec(PartitionSpec(None, MODEL_AXIS)) == PartitionSpec(DATA_AXIS, MODEL_AXIS)
    assert replica_rows_spec(PartitionSpec()) == PartitionSpec(DATA_AXIS)


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


def test_a_runner_of_replicas_in_one_program_takes_the_experts_over_them():
    with pytest.raises(ValueError, match=r"take expert parallelism \(expert_parallel=True\)"):
        RunnerConfig(model_path="m", data_parallel_size=2)
    with pytest.raises(ValueError, match="lora is not served with the experts split over data-parallel"):
        RunnerConfig(model_path="m", data_parallel_size=2, expert_parallel=True, lora=LoraConfig(1, 8))
    RunnerConfig(model_path="m", data_parallel_size=2, expert_parallel=True)
    RunnerConfig(model_path="m", data_parallel_size=2, expert_parallel=True, tensor_parallel_size=2)
