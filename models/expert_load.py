# SPDX-License-Identifier: Apache-2.0
"""Load per expert: how many of a step's real tokens each mixture-of-experts layer routed to
each of its experts, counted inside the jitted step.

A step whose `AttentionMetadata.count_expert_load` is set has every MoE layer keep its `[E]`
count as an `ExpertLoad` variable on itself (the step's own copy of the model, merged inside the
program); `collect` stacks them in layer order, `[L, E]`, an output of the program. Padding
tokens (past the step's real ones) are not counted. Nothing leaves the device per layer, and
the flag is static: a program counts or it does not, for every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.metadata import AttentionMetadata


class ExpertLoad(nnx.Intermediate):
    """A MoE layer's `[E]` int32 count of the step's (token, expert) assignments per expert."""


def record(module: nnx.Module, experts: jax.Array, num_experts: int, md: AttentionMetadata | None) -> None:
    """Keeps on `module` the count of `experts [T, k]` (each real token's chosen experts) per
    expert, when the step counts them (`md.count_expert_load`)."""
    if md is None or not md.count_expert_load:
        return
    real = md.real_tokens(experts.shape[0]).astype(jnp.int32)  # [T]
    per_assignment = jnp.broadcast_to(real[:, None], experts.shape).reshape(-1)
    counts = jnp.zeros(num_experts, jnp.int32).at[experts.reshape(-1)].add(per_assignment)
    module.expert_load = ExpertLoad(counts)


def collect(model: nnx.Module) -> jax.Array | None:
    """`[L, E]` int32: the counts `record` kept, one row per MoE layer in the model's order
    (None when no layer kept one: a dense model). The layers must have the same number of
    experts."""
    rows = [
        module.expert_load[...]
        for _, module in nnx.iter_graph(model)
        if isinstance(getattr(module, "expert_load", None), ExpertLoad)
    ]
    if not rows:
        return None
    widths = {row.shape[0] for row in rows}
    if len(widths) > 1:
        raise ValueError(f"MoE layers with different numbers of experts {sorted(widths)}: counted apart")
    return jnp.stack(rows)


def has_experts(model: nnx.Module) -> bool:
    """Whether `model` has a mixture of experts (a module with an `expert_parallel` flag)."""
    return any(hasattr(type(module), "expert_parallel") for _, module in nnx.iter_graph(model))
