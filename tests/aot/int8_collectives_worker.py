# SPDX-License-Identifier: Apache-2.0
"""Compile worker: a row-parallel int8 projection (inputs split over the chips, as `o_proj` and
`down_proj` are under tensor parallelism) compiled for a compile-only mesh, per output channel
and with scales per group of 32 inputs, beside the same projection with bfloat16 weights. Prints
one JSON line: per case, the element types of the optimized program's all-reduces.

    python -m tests.aot.int8_collectives_worker TARGET
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.int8 import int8_dot
from tpu_platform.planner.targets import compile_only_mesh

TOKENS, INPUTS, OUTPUTS, GROUP = 64, 4096, 2048, 32


def all_reduce_types(target: str, case: str) -> list[str]:
    mesh = compile_only_mesh(target)

    def abstract(shape: tuple[int, ...], dtype, spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    x = abstract((TOKENS, INPUTS), jnp.bfloat16, P(None, "model"))
    if case == "bfloat16":
        w = abstract((INPUTS, OUTPUTS), jnp.bfloat16, P("model", None))
        product = lambda x, w: jnp.einsum("td,df->tf", x, w, preferred_element_type=jnp.float32)  # noqa: E731
        args = (x, w)
    else:
        q = abstract((INPUTS, OUTPUTS), jnp.int8, P("model", None))
        per_group = ((INPUTS // GROUP, OUTPUTS), P("model", None))
        scale_shape, spec = ((OUTPUTS,), P()) if case == "int8" else per_group
        product, args = int8_dot, (x, q, abstract(scale_shape, jnp.float32, spec))
    step = jax.jit(lambda *a: product(*a).astype(jnp.bfloat16), out_shardings=NamedSharding(mesh, P()))
    text = step.lower(*args).compile().as_text()
    return re.findall(r"= (\w+)\[[^\]]*\]\S* all-reduce(?:-start)?\(", text)


def main(target: str) -> None:
    print(json.dumps({case: all_reduce_types(target, case) for case in ("bfloat16", "int8", "int8-g32")}))


if __name__ == "__main__":
    main(sys.argv[1])
