# SPDX-License-Identifier: Apache-2.0
"""vLLM's data-parallel options on this platform: one worker in each replica's engine process,
the replicas on this host counted at start, each replica's own devices claimed before JAX starts,
(what is not built is refused by name: `test_feature_check.py`).

The serving itself (two replicas through the OpenAI server) is `test_data_parallel.py`."""

from __future__ import annotations

import os

import jax
import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.utils import set_assigned_physical_gpu_ids_for_dp_rank

from plugin_shim.cli import serve_argv
from plugin_shim.data_parallel import Replica, claim_devices, replica
from plugin_shim.vllm_serve import is_link_head, liveness_link, parse_serve
from tests.tiny_models import save_tiny_llama
from tpu_platform.liveness import LinkConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("dp") / "model"))


def test_replicas_run_one_worker_in_their_engine_process_on_their_own_devices(model):
    config = EngineArgs(
        model=model, max_model_len=64, data_parallel_size=2, tensor_parallel_size=2
    ).create_engine_config()
    assert config.parallel_config.distributed_executor_backend == "uni"  # vLLM's own pick is mp
    set_assigned_physical_gpu_ids_for_dp_rank(config, 1)  # vLLM's launcher, for local rank 1
    config.parallel_config.reconfigure_for_independent_dp_rank()  # what vLLM does to a dense replica
    assert replica(config) == Replica(device_ids=(2, 3))


def test_an_engine_process_drives_the_devices_vllm_assigned_it(model):
    """`--device-ids` (vLLM's `assigned_physical_gpu_ids`), and each local DP rank's slice of it
    or of the host's devices, which vLLM's engine launcher writes into the rank's configuration."""
    config = EngineArgs(model=model, max_model_len=64, device_ids=[3]).create_engine_config()
    assert replica(config) == Replica(device_ids=(3,))
    config = EngineArgs(
        model=model, max_model_len=64, data_parallel_size=2, tensor_parallel_size=2, device_ids=[4, 5, 6, 7]
    ).create_engine_config()
    set_assigned_physical_gpu_ids_for_dp_rank(config, 1, [4, 5, 6, 7])  # vLLM's launcher, for rank 1
    config.parallel_config.data_parallel_index = 0  # not what picks the devices: vLLM's slice does
    assert replica(config) == Replica(device_ids=(6, 7))


def test_one_replica_is_no_data_parallelism(model):
    config = EngineArgs(
        model=model, max_model_len=64, distributed_executor_backend="mp"
    ).create_engine_config()
    assert replica(config) is None
    assert config.parallel_config.distributed_executor_backend == "uni"


def test_a_tpu_replica_sees_only_its_chips(monkeypatch):
    for name in (
        "TPU_CHIPS_PER_PROCESS_BOUNDS",
        "TPU_PROCESS_BOUNDS",
        "TPU_VISIBLE_CHIPS",
        "TPU_PROCESS_PORT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TPU_PROCESS_ADDRESSES", raising=False)
    runtime = claim_devices(Replica(device_ids=(4, 5, 6, 7)), "tpu")
    assert runtime["TPU_VISIBLE_CHIPS"] == os.environ["TPU_VISIBLE_CHIPS"] == "4,5,6,7"
    assert runtime["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    assert runtime["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert runtime["TPU_PROCESS_PORT"] != "8476"  # replica 0 has the runtime's default
    with pytest.raises(ValueError, match="a data-parallel replica of 3 TPU chips"):
        claim_devices(Replica(device_ids=(0, 1, 2)), "tpu")


def test_a_gpu_replica_sees_only_its_gpus():
    before = jax.config.values["jax_cuda_visible_devices"]
    try:
        assert claim_devices(Replica(device_ids=(4, 5)), "gpu") == {}
        assert jax.config.values["jax_cuda_visible_devices"] == "4,5"
    finally:
        jax.config.update("jax_cuda_visible_devices", before)


def test_a_cpu_replica_keeps_its_own_simulated_devices():
    assert claim_devices(Replica(device_ids=(2, 3)), "cpu") == {}


def test_replicas_over_hosts_join_a_liveness_link_from_vllms_options():
    """`vllm-xla serve` runs them through `plugin_shim.vllm_serve`, whose link comes from vLLM's
    own data-parallel options as its `serve` parses them (the link itself: test_liveness)."""
    hosts = ["--data-parallel-size", "4", "-dpl", "2", "--data-parallel-address", "10.0.0.2"]
    assert serve_argv("M", hosts)[1:3] == ["-m", "plugin_shim.vllm_serve"]
    _, args = parse_serve(
        ["M", *hosts, "--data-parallel-rpc-port", "4000", "--distributed-timeout-seconds", "30"]
    )
    assert liveness_link(args) == LinkConfig("10.0.0.2", 4001, silence_seconds=30, join_seconds=30)
    _, args = parse_serve(["M", *hosts, "--headless", "--data-parallel-start-rank", "2"])
    assert liveness_link(args) == LinkConfig("10.0.0.2", 29551, silence_seconds=100, join_seconds=300)
    assert liveness_link(parse_serve(["M", "--data-parallel-size", "2"])[1]) is None  # one host
    assert liveness_link(parse_serve(["M", "--data-parallel-size", "2", "-dpl", "2"])[1]) is None


@pytest.mark.parametrize(
    ("options", "heads"),
    [
        # external load balancing: every rank its own API server, rank 0's listening
        (["-dp", "2", "--data-parallel-rank", "{rank}"], [True, False]),
        (["-dp", "2", "--data-parallel-external-lb", "--data-parallel-rank={rank}"], [True, False]),
        # hybrid: each host's API server over its own ranks, host 0's (no start rank) listening
        (["-dp", "4", "-dpl", "2", "--data-parallel-hybrid-lb", "-dpr", "{start}"], [True, False]),
        (["-dp", "4", "-dpl", "2", "--data-parallel-start-rank", "{start}"], [True, False]),
        # across hosts behind host 0's API server: the others --headless
        (["-dp", "4", "-dpl", "2", "-dpr", "{start}", "{headless}"], [True, False]),
    ],
    ids=["external_rank", "external_lb", "hybrid_lb", "hybrid_by_start_rank", "headless_hosts"],
)
def test_replicas_started_one_by_one_link_their_servers_to_rank_0s(options, heads):
    for index, head in enumerate(heads):
        fill = {
            "rank": str(index),
            "start": str(2 * index),
            "headless": "--headless" if index else "--port=8000",
        }
        argv = [arg.format(**fill) for arg in options]
        assert serve_argv("M", argv)[1:3] == ["-m", "plugin_shim.vllm_serve"]
        _, args = parse_serve(["M", *argv, "--data-parallel-rpc-port", "5000"])
        assert liveness_link(args) == LinkConfig("127.0.0.1", 5001, silence_seconds=100, join_seconds=300)
        assert is_link_head(args) is head, argv


def test_vllms_supervisor_of_one_server_a_rank_is_refused_naming_the_launch_that_works():
    for flag in ("--data-parallel-multi-port-external-lb", "-dpm"):
        with pytest.raises(
            SystemExit, match=r"multi-port-external-lb is not supported: .* --data-parallel-rank R"
        ):
            serve_argv("M", ["-dp", "4", "-dpl", "2", flag])
