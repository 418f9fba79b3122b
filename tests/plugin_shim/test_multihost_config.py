# SPDX-License-Identifier: Apache-2.0
"""vLLM's multi-node options on this platform: one worker a host, the mesh over all of them.

The serving itself (two hosts, a killed host, a missing host) is `test_multihost.py`.
"""

from __future__ import annotations

import sys

import jax
import pytest
from vllm.engine.arg_utils import EngineArgs

from plugin_shim.cli import serve_argv
from plugin_shim.hosts import host_group, naming_lost_hosts
from plugin_shim.parallel import MESH_TP_KEY, configure_parallel, mesh_tensor_parallel_size
from plugin_shim.speculative import unsupported_speculation
from tests.tiny_models import save_tiny_llama
from tpu_platform.hosts import HostGroup

MULTI_NODE = dict(nnodes=2, node_rank=1, master_addr="10.0.0.2", master_port=29501, max_model_len=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_llama(
        str(tmp_path_factory.mktemp("mh") / "model"), num_attention_heads=8, hidden_size=128
    )


def test_vllm_runs_one_worker_a_host_and_the_mesh_spans_them_all(model):
    config = EngineArgs(model=model, tensor_parallel_size=4, **MULTI_NODE).create_engine_config()
    parallel = config.parallel_config
    assert (parallel.tensor_parallel_size, parallel.world_size, parallel.local_world_size) == (2, 2, 1)
    assert parallel.distributed_executor_backend == "mp"
    assert mesh_tensor_parallel_size(config) == 4
    assert config.scheduler_config.async_scheduling is False
    configure_parallel(config)  # vLLM's hook may run again: nothing changes
    assert (parallel.tensor_parallel_size, parallel.world_size, mesh_tensor_parallel_size(config)) == (
        2,
        2,
        4,
    )
    group = host_group(config)
    assert group == HostGroup("10.0.0.2:29502", num_hosts=2, host_rank=1, timeout_seconds=None)


def test_the_distributed_timeout_option_bounds_the_hosts_join(model):
    """`--distributed-timeout-seconds` reaches the host group, whose seconds are JAX's join and
    heartbeat bounds (the next test): a host that never joins ends the other within it."""
    options = dict(MULTI_NODE, node_rank=0, distributed_timeout_seconds=45)
    config = EngineArgs(model=model, tensor_parallel_size=4, **options).create_engine_config()
    assert host_group(config) == HostGroup("10.0.0.2:29502", num_hosts=2, host_rank=0, timeout_seconds=45)


def test_one_host_keeps_vllms_sizes(model):
    config = EngineArgs(model=model, tensor_parallel_size=1, max_model_len=64).create_engine_config()
    assert MESH_TP_KEY not in config.additional_config
    assert host_group(config) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(tensor_parallel_size=3), r"`--nnodes 2` must evenly divide the total world size \(3\)"),
        (
            dict(tensor_parallel_size=4, distributed_executor_backend="external_launcher"),
            r"distributed_executor_backend='external_launcher' is not supported by vllm-xla across hosts",
        ),
        (
            dict(tensor_parallel_size=6),
            r"attention heads \(8\) must be divisible by tensor parallel size \(6\)",
        ),
    ],
)
def test_impossible_multi_host_configurations_are_refused_by_name(model, options, message):
    with pytest.raises(Exception, match=message):
        EngineArgs(model=model, **options, **MULTI_NODE).create_engine_config()


def test_host_group_checks_its_numbers():
    with pytest.raises(ValueError, match="host rank 2 is not in"):
        HostGroup("h:1", num_hosts=2, host_rank=2)
    with pytest.raises(ValueError, match="at least 2 hosts"):
        HostGroup("h:1", num_hosts=1, host_rank=0)


def test_serve_passes_the_multi_node_options_through_to_vllms_serve_command():
    options = ["--nnodes", "4", "--node-rank", "2", "--master-addr", "10.0.0.2", "--master-port", "29501"]
    assert serve_argv("M", options) == [sys.executable, "-m", "plugin_shim.vllm_serve", "M", *options]
    assert serve_argv("M", ["--port", "1"]) == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "M", "--port", "1",
    ]  # fmt: skip
    assert serve_argv("M", [*options, "--headless"]) == [
        sys.executable, "-m", "plugin_shim.vllm_serve", "M", *options, "--headless",
    ]  # fmt: skip


def test_host_0s_coordinator_listens_on_the_master_address_only(monkeypatch):
    """JAX's coordinator has no authentication and binds every interface by default: it is
    bound to the master address (the others connect there), with the join's bounds."""
    import jax

    from tpu_platform import hosts

    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **options: joined.append(options))
    monkeypatch.setattr(hosts, "check_joined", lambda group: None)
    hosts.join_hosts(HostGroup("10.0.0.2:29502", num_hosts=2, host_rank=0, timeout_seconds=30), "tpu")
    assert joined == [
        dict(
            coordinator_address="10.0.0.2:29502",
            coordinator_bind_address="10.0.0.2:29502",
            num_processes=2,
            process_id=0,
            initialization_timeout=30,
            heartbeat_timeout_seconds=30,
        )
    ]


@pytest.mark.parametrize("num_hosts", [1, 2])
def test_a_step_failure_names_lost_hosts_only_across_hosts(num_hosts):
    failure = jax.errors.JaxRuntimeError("collective peer gone")
    expected = RuntimeError if num_hosts > 1 else jax.errors.JaxRuntimeError
    with pytest.raises(expected) as raised, naming_lost_hosts(num_hosts):
        raise failure
    assert (raised.value is failure) == (num_hosts == 1)
    assert ("another host died" in str(raised.value)) == (num_hosts > 1)


def test_a_drafter_across_hosts_is_split_on_the_whole_mesh(model):
    """vLLM's `draft_tensor_parallel_size` defaults to the TP size asked for (the mesh's), which
    is what the drafter is split on, though vLLM's own TP size becomes one rank a host."""
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    config = EngineArgs(
        model=model, tensor_parallel_size=4, speculative_config=spec, **MULTI_NODE
    ).create_engine_config()
    assert config.speculative_config.draft_tensor_parallel_size == 4
    assert config.parallel_config.tensor_parallel_size == 2
    assert unsupported_speculation(config) is None  # as vLLM's hook finds it if it runs again
    config.speculative_config.draft_tensor_parallel_size = 2  # one host's devices: not the mesh
    assert unsupported_speculation(config) == "draft_tensor_parallel_size=2 with tensor_parallel_size=4"
