# SPDX-License-Identifier: Apache-2.0
"""Compile worker: one projection carrying LoRA slots (`models.lora`), as the step runs it
(`set_lora_tokens`, then `Linear.product`), compiled for a compile-only TPU or GPU at a few token
counts. Llama-3.1-8B's fused gate/up shape, bfloat16, 4 adapter slots of rank 16. Prints one
JSON line: per token count, the program's temporary bytes over the weight's bytes and over the
bytes of its `[T, out]` float32 output.

    python -m tests.aot.lora_product_worker TARGET TOKENS[,TOKENS...]
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from models.linear import Linear
from models.lora import LoraWeights, set_lora_tokens
from tpu_platform.targets import compile_only_devices

INPUTS, OUTPUTS, MAX_LORAS, PARTS, RANK = 4096, 2 * 14336, 4, 2, 16


def temp_bytes(target: str, tokens: int) -> dict[str, float]:
    device = compile_only_devices(target)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract_model() -> Linear:
        linear = Linear(INPUTS, OUTPUTS, bias=False, dtype=jnp.bfloat16)
        slots = MAX_LORAS + 1
        a = jnp.zeros((slots, INPUTS, PARTS * RANK), jnp.bfloat16)
        linear.lora = LoraWeights(a, jnp.zeros((slots, PARTS * RANK, OUTPUTS), jnp.bfloat16))
        return linear

    graphdef, state = nnx.split(nnx.eval_shape(abstract_model))
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


def main(target: str, tokens: str) -> None:
    print(json.dumps({t: temp_bytes(target, int(t)) for t in tokens.split(",")}))


if __name__ == "__main__":
    main(*sys.argv[1:])
