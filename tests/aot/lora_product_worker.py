# SPDX-License-Identifier: Apache-2.0
"""Compile worker: a projection carrying LoRA slots (`models.lora`), as the step runs it
(`set_lora_tokens`, then `Linear.product`), compiled for a compile-only TPU or GPU. Llama-3.1-8B's
shapes, bfloat16, 4 adapter slots of rank 16. Prints one JSON line.

    python -m tests.aot.lora_product_worker TARGET TOKENS[,TOKENS...]

On a one-chip target: the fused gate/up projection at each token count, its temporary bytes over
the weight's bytes and over the bytes of its `[T, out]` float32 output. On a mesh: the fused
gate/up (column-parallel) and o_proj (row-parallel) projections placed by `models.sharding`'s
rules, the collectives of each compiled program (op, result shape).
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from models.linear import Linear
from models.lora import LoraWeights, set_lora_tokens
from models.sharding import key_path_name, parameter_sharding
from tpu_platform.planner.targets import compile_only_devices, compile_only_mesh

INPUTS, OUTPUTS, MAX_LORAS, PARTS, RANK = 4096, 2 * 14336, 4, 2, 16
# a collective in optimized HLO: its result shape (e.g. `bf16[11,8,32]`) and its op
COLLECTIVE = re.compile(
    r"= (\w+\[[\d,]*\])\S* (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\("
)


def temp_bytes(target: str, tokens: int) -> dict[str, float]:
    device = compile_only_devices(target)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    graphdef, state = abstract_state(INPUTS, OUTPUTS)
    state = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding), state)

    def step(state, x, slots):
        model = nnx.merge(graphdef, state)
        set_lora_tokens(model, slots)
        return model.product(x)

    args = (
        jax.ShapeDtypeStruct((tokens, INPUTS), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding),
    )
    with jax.default_device(device):
        compiled = jax.jit(step).trace(state, *args).lower().compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {"per_weight": temp / (INPUTS * OUTPUTS * 2), "per_output": temp / (tokens * OUTPUTS * 4)}


def abstract_state(in_features: int, out_features: int):
    """A Linear with LoRA slots, abstract: its graphdef and state."""

    def build() -> Linear:
        linear = Linear(in_features, out_features, bias=False, dtype=jnp.bfloat16)
        slots, rank = MAX_LORAS + 1, PARTS * RANK
        a = jnp.zeros((slots, in_features, rank), jnp.bfloat16)
        linear.lora = LoraWeights(a, jnp.zeros((slots, rank, out_features), jnp.bfloat16))
        return linear

    return nnx.split(nnx.eval_shape(build))


def collectives(target: str, tokens: int) -> dict[str, list[list[str]]]:
    mesh = compile_only_mesh(target)
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    found = {}
    for site, (n_in, n_out), x_spec in (
        ("mlp.gate_up_proj", (INPUTS, OUTPUTS), jax.sharding.PartitionSpec()),
        ("self_attn.o_proj", (INPUTS, INPUTS), jax.sharding.PartitionSpec(None, "model")),
    ):
        graphdef, state = abstract_state(n_in, n_out)
        state = jax.tree_util.tree_map_with_path(
            lambda path, v, site=site: jax.ShapeDtypeStruct(
                v.shape,
                v.dtype,
                sharding=parameter_sharding(f"model.layers.0.{site}.{key_path_name(path)}", v.shape, mesh),
            ),
            state,
        )

        def step(state, x, slots, graphdef=graphdef):
            model = nnx.merge(graphdef, state)
            set_lora_tokens(model, slots)
            return model.product(x)

        x = jax.ShapeDtypeStruct(
            (tokens, n_in), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, x_spec)
        )
        slots = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=whole)
        text = jax.jit(step).trace(state, x, slots).lower().compile().as_text()
        ops = re.findall(COLLECTIVE, text)
        found[site] = [[op, shape] for shape, op in ops]
    return found


def main(target: str, tokens: str) -> None:
    if len(compile_only_devices(target)) > 1:
        print(json.dumps(collectives(target, int(tokens))))
    else:
        print(json.dumps({t: temp_bytes(target, int(t)) for t in tokens.split(",")}))


if __name__ == "__main__":
    main(*sys.argv[1:])
