# SPDX-License-Identifier: Apache-2.0
"""Compile worker: the runner's sharded forward step on a multi-host TPU slice, on the mesh the
hosts build at run time (`tpu_platform.hosts.per_host_devices`: a compile-only pod topology's
devices carry their host, as `jax.devices()` does on a pod), weights abstract. Prints one JSON
line: the mesh's hosts, the compiled program's partitions, collectives and bytes per chip.

    python -m tests.aot.multihost_compile_worker TARGET MODEL TP BACKEND

Run through `tests.aot.toolchains.run_worker` (the compiler's toolchain on the path, JAX on CPU).
"""

from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import attach_rope_tables, build, prepare_for_serving
from models.sharding import MODEL_AXIS, key_path_name, kv_heads_on_mesh, parameter_sharding
from pallas_kernels import kv_cache_partition_spec
from tpu_platform.buckets import StepBuckets
from tpu_platform.hosts import per_host_devices
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.kv_cache import allocate_stacked_caches, caches_per_array, kv_cache_dtype
from tpu_platform.plan import kv_layout, model_config
from tpu_platform.runner_config import default_page_size
from tpu_platform.step import make_forward
from tpu_platform.targets import compile_only_devices

DTYPE = "bfloat16"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64  # a decode step of 64 sequences, one token each
NUM_PAGES = 1024


def _abstract_state(config, tp: int, mesh: Mesh):
    """The served model (fused, KV heads repeated for `tp`) as abstract leaves on `mesh`."""

    def prepared() -> nnx.Module:
        model = build(config, jnp.dtype(DTYPE))
        prepare_for_serving(model, config, tp)
        return model

    model = nnx.eval_shape(prepared)
    attach_rope_tables(model, MAX_MODEL_LEN)
    graphdef, state = nnx.split(model)
    placed = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=parameter_sharding(key_path_name(path), leaf.shape, mesh)
        ),
        state,
    )
    leaves, state_def = jax.tree.flatten(placed)
    return graphdef, state_def, leaves


def compile_step(target: str, model_name: str, tp: int, backend: str) -> dict:
    devices = compile_only_devices(target)
    num_hosts = len({d.process_index for d in devices})
    mesh = Mesh(np.array(per_host_devices(tp, num_hosts, devices)), (MODEL_AXIS,))
    config = model_config(model_name)
    graphdef, state_def, leaves = _abstract_state(config, tp, mesh)
    layout = kv_layout(config)
    kv_dtype = kv_cache_dtype(DTYPE)
    page_size = default_page_size("tpu", None)
    heads = kv_heads_on_mesh(config.num_heads, config.num_kv_heads, tp)
    split = NamedSharding(mesh, kv_cache_partition_spec(backend, MODEL_AXIS))
    caches = [
        jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=split)
        for c in jax.eval_shape(
            lambda: allocate_stacked_caches(
                layout.num_caches, NUM_PAGES, page_size, heads, config.head_dim, kv_dtype, backend
            )
        )
    ]
    per_array = caches_per_array(layout.num_caches, NUM_PAGES, page_size)
    forward = make_forward(
        graphdef, state_def, backend, layout.layer_groups, layout.layer_caches, kv_dtype.name,
        cache_pages=NUM_PAGES, caches_per_array=per_array, mesh=mesh, cache_shardings=[split] * len(caches),
    )  # fmt: skip
    buckets = StepBuckets.for_limits(
        max_num_batched_tokens=MAX_NUM_SEQS, max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN, page_size=page_size,
    )  # fmt: skip
    t_pad, r_pad, p_pad = buckets.shape_for(MAX_NUM_SEQS, MAX_NUM_SEQS)
    packed, dims = pack_inputs(padding_inputs(t_pad, r_pad, p_pad, layout.num_groups))
    whole = NamedSharding(mesh, PartitionSpec())
    packed = jax.ShapeDtypeStruct(packed.shape, packed.dtype, sharding=whole)
    fed = jax.ShapeDtypeStruct((MAX_NUM_SEQS,), np.int32, sharding=whole)
    start = time.perf_counter()
    with jax.default_device(devices[0]):  # the Pallas backends lower for the target's platform
        compiled = forward.trace(leaves, caches, packed, fed, dims=dims).lower().compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    weight_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    return {
        "target": target, "model": model_name, "tp": tp, "backend": backend,
        "hosts": num_hosts,
        "mesh_hosts": [d.process_index for d in mesh.devices.flat],
        "num_partitions": int(re.search(r"num_partitions=(\d+)", text).group(1)),
        "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)),
        "all_gathers": len(re.findall(r"= \S+ all-gather(?:-start)?\(", text)),
        "num_layers": config.num_layers,
        "weight_bytes": weight_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "compile_seconds": seconds,
    }  # fmt: skip


if __name__ == "__main__":
    target, model, tp, backend = sys.argv[1:]
    print(json.dumps(compile_step(target, model, int(tp), backend)))
