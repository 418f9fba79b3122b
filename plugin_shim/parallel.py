# SPDX-License-Identifier: Apache-2.0
"""vLLM's parallel options on this platform: tensor parallelism by one process over a mesh.

`tensor_parallel_size=N` is served by one worker driving a JAX mesh of N local devices
(`tpu_platform.mesh`), so vLLM's executor is its single-process `uni` one whatever N is (JAX's
SPMD programs do the devices' exchanges; no torch process group exists). What is not built is
refused here, at start, by name: pipeline parallelism, several nodes, the Ray executor, and a
model whose heads do not split N ways. Too few devices is refused by the worker, the first
process that may open them (`tpu_platform.mesh.check_devices`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpu_platform.mesh import check_model_fits_mesh

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def configure_parallel(vllm_config: VllmConfig) -> None:
    """Checks the parallel options and makes vLLM run the one worker (`uni` executor)."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "nnodes", 1) > 1:
        raise ValueError(
            "vllm-xla serves from one host: --nnodes > 1 is not supported; "
            "use --tensor-parallel-size up to this host's device count"
        )
    backend = parallel.distributed_executor_backend
    if parallel.tensor_parallel_size > 1:
        if backend not in (None, "mp", "uni"):
            raise ValueError(
                f"distributed_executor_backend={backend!r} is not supported by vllm-xla: one process "
                "drives every device of the host; leave --distributed-executor-backend unset"
            )
        # vLLM picks `mp` (one process a device) for world_size > 1; ours is one process.
        parallel.distributed_executor_backend = "uni"
    model = vllm_config.model_config
    hf = getattr(model, "hf_text_config", None) if model is not None else None
    if hf is not None and parallel.tensor_parallel_size > 1:
        heads = getattr(hf, "num_attention_heads", None)
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        if heads:
            check_model_fits_mesh(heads, kv_heads, parallel.tensor_parallel_size)
