# SPDX-License-Identifier: Apache-2.0
"""vLLM's parallel options on this platform: tensor parallelism by one process over a mesh.

`tensor_parallel_size=N` is served by one worker driving a JAX mesh of N local devices
(`tpu_platform.mesh`), so vLLM's executor is its single-process `uni` one whatever N is (JAX's
SPMD programs do the devices' exchanges; no torch process group exists). What is not built is
refused here, at start, by name: pipeline parallelism, the Ray executor, and a model whose heads,
MLP or experts do not split N ways. Too few devices is refused by the worker, the first process
that may open them (`tpu_platform.mesh.check_devices`).

Several hosts (`--nnodes > 1`, docs/multihost.md): vLLM's multiprocessing executor in multi-node
mode starts `world_size / nnodes` workers per host; we want one, driving all of its host's devices.
So vLLM is told the tensor-parallel size is `nnodes` (one rank a host), and the size asked for is
kept in `additional_config[MESH_TP_KEY]`: the mesh the worker builds over every host's devices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.sharding import check_expert_parallel, check_tensor_parallel
from plugin_shim.data_parallel import expert_replicas
from tpu_platform.mesh import check_model_fits_mesh

if TYPE_CHECKING:
    from vllm.config import VllmConfig


# Where the tensor-parallel size asked for is kept when vLLM's is one rank a host.
MESH_TP_KEY = "xla_tensor_parallel_size"


def mesh_tensor_parallel_size(vllm_config: VllmConfig) -> int:
    """The devices the model is split over: all hosts' together (vLLM's own TP size on one host)."""
    extra = getattr(vllm_config, "additional_config", None)  # a config built by hand may lack it
    if isinstance(extra, dict) and MESH_TP_KEY in extra:
        return int(extra[MESH_TP_KEY])
    return vllm_config.parallel_config.tensor_parallel_size


def configure_parallel(vllm_config: VllmConfig) -> None:
    """Checks the parallel options and makes vLLM run one worker a host (`uni` executor on one,
    `mp` in multi-node mode on several)."""
    parallel = vllm_config.parallel_config
    if parallel.nnodes > 1:
        _one_worker_per_host(vllm_config)
        _check_splits(vllm_config, mesh_tensor_parallel_size(vllm_config))
        _async_scheduling_off_across_hosts(vllm_config)
        return
    backend = parallel.distributed_executor_backend
    if backend not in (None, "mp", "uni"):
        raise ValueError(
            f"distributed_executor_backend={backend!r} is not supported by vllm-xla: one process "
            "drives every device of the host; leave --distributed-executor-backend unset"
        )
    # vLLM picks `mp` (one process a device) for world_size > 1 and for data parallelism; ours
    # is one worker in each engine process (a data-parallel replica's own). `mp` would also run
    # an async-scheduled step's output on a thread of its own beside the next step.
    parallel.distributed_executor_backend = "uni"
    _check_splits(vllm_config, parallel.tensor_parallel_size)


def _check_splits(vllm_config: VllmConfig, tp_size: int) -> None:
    """Refuses, at start, a TP size that the model's heads or another dimension the rules table
    splits (the MLP's or the experts' intermediate size) do not divide (`check_model_fits_mesh`)."""
    model = vllm_config.model_config
    hf = getattr(model, "hf_text_config", None) if model is not None else None
    replicas = expert_replicas(vllm_config)
    if hf is None or tp_size * replicas <= 1:
        return
    try:
        fields = hf.to_dict()
        # A text config inside a multimodal one names no architecture: the model's does.
        fields["architectures"] = fields.get("architectures") or list(model.architectures)
        config = ModelConfig.from_hf_dict(fields)
    except (AttributeError, KeyError, TypeError, ValueError):  # a layout we do not parse: its heads
        heads = getattr(hf, "num_attention_heads", None)
        if heads:
            check_tensor_parallel(heads, getattr(hf, "num_key_value_heads", None) or heads, tp_size)
        return
    expert_parallel = bool(vllm_config.parallel_config.enable_expert_parallel)
    check_model_fits_mesh(config, tp_size, expert_parallel=expert_parallel)
    if replicas > 1 and config.num_experts:  # the experts split over every replica's devices
        check_expert_parallel(config.num_experts, replicas * tp_size, replicas=replicas)


def _one_worker_per_host(vllm_config: VllmConfig) -> None:
    """vLLM's multi-node executor with one rank (one worker) a host; idempotent."""
    parallel = vllm_config.parallel_config
    nnodes = parallel.nnodes
    if parallel.distributed_executor_backend not in (None, "mp"):
        raise ValueError(
            f"distributed_executor_backend={parallel.distributed_executor_backend!r} is not supported "
            "by vllm-xla across hosts: it uses vLLM's multiprocessing executor in multi-node mode "
            "(--nnodes, --node-rank, --master-addr, --headless on hosts other than 0); leave "
            "--distributed-executor-backend unset"
        )
    extra = getattr(vllm_config, "additional_config", None)  # a config built by hand may lack it
    if not isinstance(extra, dict):
        raise ValueError("vllm-xla across hosts needs --additional-config to be a JSON object")
    if MESH_TP_KEY not in extra:
        tp = parallel.tensor_parallel_size
        if tp % nnodes:
            raise ValueError(
                f"tensor_parallel_size={tp} does not split over --nnodes {nnodes}: each host drives "
                f"an equal share of the devices; use a multiple of {nnodes} (e.g. {nnodes} x the "
                "devices of one host)"
            )
        extra[MESH_TP_KEY] = tp
    parallel.tensor_parallel_size = nnodes
    parallel.world_size = nnodes * parallel.pipeline_parallel_size * parallel.prefill_context_parallel_size
    parallel.distributed_executor_backend = "mp"


def _async_scheduling_off_across_hosts(vllm_config: VllmConfig) -> None:
    """Across hosts, every host's runner must record each step's tokens before the next step, as
    host 0's does: vLLM's multi-node executor resolves an async output on the replying host only
    (in a thread of its own) and drops the other hosts' handles, whose runners would then go out
    of step. So each step's output is returned when sampled (docs/multihost.md)."""
    scheduler = vllm_config.scheduler_config
    if scheduler is None or not scheduler.async_scheduling:
        return
    scheduler.async_scheduling = False
    from vllm.logger import init_logger

    init_logger("vllm.xla").info(
        "vllm-xla: async scheduling is off across hosts (--nnodes > 1): every host records each "
        "step's tokens before the next step"
    )
