# SPDX-License-Identifier: Apache-2.0
"""The model the runner would load with its weights abstract (`abstract_model`: `ShapeDtypeStruct`s,
no memory), prepared, quantized and placed as the runner does, and the bytes they take on a chip
(`device_bytes`: int4 two values a byte, as TPU and GPU store it)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from models import ModelConfig, attach_rope_tables, build, int4, prepare_for_serving
from models.expert_load import has_experts
from models.layer_stacks import stack_layer_weights
from models.lora import attach_lora
from models.moe import use_expert_parallel
from models.serving_passes import use_native_norms
from models.sharding import state_shardings
from tpu_platform.lora_slots import LoraConfig
from tpu_platform.weights.preparation import Preparation


@dataclasses.dataclass(frozen=True, slots=True)
class AbstractModel:
    """A model's program structure and its weights as `ShapeDtypeStruct`s (no memory), and the
    abstract state they come from (its paths are what the rules table matches)."""

    graphdef: nnx.GraphDef
    state_def: jax.tree_util.PyTreeDef
    leaves: tuple[jax.ShapeDtypeStruct, ...]
    state: nnx.State  # the abstract state itself, for the rules table's shardings
    expert_parallel: bool = False  # the experts placed by index (`models.sharding`)
    has_experts: bool = False  # a mixture of experts: its step counts the load per expert

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's state as the runner holds it (weights and RoPE tables)."""
        return sum(device_bytes(leaf.shape, leaf.dtype) for leaf in self.leaves)

    def placed(self, mesh: Mesh | None, device: jax.Device) -> list[jax.ShapeDtypeStruct]:
        """The leaves as the runner places them: on `device`, or on `mesh` with the shardings of
        `models.sharding`'s rules table (`state_shardings`, as `place_state` puts them)."""
        if mesh is None:
            return placed_on(device, list(self.leaves))
        shardings = jax.tree.leaves(state_shardings(self.state, mesh, expert_parallel=self.expert_parallel))
        return [abstract_leaf(leaf, sharding) for leaf, sharding in zip(self.leaves, shardings, strict=True)]

    def chip_weight_bytes(self, mesh: Mesh | None) -> int:
        """Bytes of the state one chip holds: all of it, or on `mesh` its shard of each weight."""
        if mesh is None:
            return self.weight_bytes
        shards = self.placed(mesh, None)
        return sum(device_bytes(leaf.sharding.shard_shape(leaf.shape), leaf.dtype) for leaf in shards)


@functools.cache
def abstract_model(
    config: ModelConfig,
    dtype: str,
    max_model_len: int,
    tp_size: int = 1,
    quantization: str = "none",
    lora: LoraConfig | None = None,
    expert_parallel: bool = False,
    backend: str | None = None,
    replicas: int = 1,
) -> AbstractModel:
    """The model the runner would load, weights abstract: built under `nnx.eval_shape` and
    prepared as `models.load_model` prepares it for `tp_size` devices (KV heads repeated up to
    the TP size when fewer, the tied head's copy, fused projections in one block a device), then
    quantized as the runner's `Preparation` does ("int8": int8 kernels and their scales), with
    the RoPE tables the runner attaches for `max_model_len` positions and, with `lora`, the
    adapter slots `Runner.load_model` attaches; `expert_parallel`: its MoE layers flagged and
    their experts placed by index, as the runner does under `--enable-expert-parallel` (over the
    `tp_size` chips, or over `replicas` data-parallel replicas of one chip each).
    `backend`: the platform served ("tpu", "cuda"; None: JAX's default backend), which holds
    int4 values as int4 or int8 (`models.int4`)."""
    preparation = Preparation(
        jnp.dtype(dtype).name, tp_size=tp_size, quantization=quantization, backend=backend
    )

    def prepared(model: nnx.Module) -> nnx.Module:
        prepare_for_serving(model, config, tp_size)
        preparation.apply(model)
        return model

    # Prepared from abstract arguments: built inside, the placeholders would be concrete host
    # zeros, which the fused projections' concatenation would then really fill.
    model = nnx.eval_shape(prepared, nnx.eval_shape(lambda: build(config, jnp.dtype(dtype))))
    if tp_size == 1:  # as the runner stacks them (`runner_state.load_runner_model`)
        stack_layer_weights(model)
        use_native_norms(model)
    attach_rope_tables(model, max_model_len)
    expert_parallel = expert_parallel and tp_size * replicas > 1
    if expert_parallel:
        use_expert_parallel(model)
    if lora is not None:
        lora_dtype = jnp.dtype(lora.dtype or dtype)
        attach_lora(
            model, max_loras=lora.max_loras, max_rank=lora.max_lora_rank, dtype=lora_dtype, blocks=tp_size
        )
    graphdef, state = nnx.split(model)
    leaves, state_def = jax.tree.flatten(state)
    return AbstractModel(
        graphdef, state_def, tuple(abstract_leaf(leaf) for leaf in leaves), state, expert_parallel,
        has_experts=has_experts(model),
    )  # fmt: skip


def device_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """An array's device bytes: int4 two values a byte (as TPU and GPU store it)."""
    if int4.is_int4(dtype):
        return -(-math.prod(shape) // 2)
    return math.prod(shape) * np.dtype(dtype).itemsize


def abstract_leaf(x: Any, sharding: jax.sharding.Sharding | None = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def placed_on(device: jax.Device, tree: Any) -> Any:
    """`tree`'s leaves as `ShapeDtypeStruct`s placed on `device`."""
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda x: abstract_leaf(x, sharding), tree)
