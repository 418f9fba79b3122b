# SPDX-License-Identifier: Apache-2.0
"""Run by `test_moe_on_mesh.py` in a process with 4 simulated CPU devices: the mixture of experts
split over a mesh against the one-device routed path, float and int8, affine 4-bit (zero points:
offsets per group and per channel) and GPTQ act-order experts (each expert's own input order)
split inside each expert and by expert index, and the all-reduces of its compiled program.
Prints one JSON object."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models.int8 import quantize_per_channel
from models.moe import experts_by_index, experts_routed, experts_routed_on_mesh, route
from tpu_platform.planner.hlo import hlo_collectives

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 7, 16, 32, 8, 2


def main() -> None:
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(TOKENS, HIDDEN)), jnp.float32)
    shapes = [(EXPERTS, HIDDEN, FFN), (EXPERTS, HIDDEN, FFN), (EXPERTS, FFN, HIDDEN)]
    stacks = tuple(jnp.asarray(rng.normal(size=s) * 0.2, jnp.float32) for s in shapes)
    router_logits = jnp.asarray(rng.normal(size=(TOKENS, EXPERTS)), jnp.float32)
    weights, experts = route(router_logits, TOP_K, renormalize=True)
    quantized = [quantize_per_channel(np.asarray(s)) for s in stacks]
    int8 = tuple(jnp.asarray(q) for q, _ in quantized)
    scales = tuple(jnp.asarray(s) for _, s in quantized)

    def on_mesh(x, stacks, weights, experts, scales):
        return experts_routed_on_mesh(mesh, x, stacks, weights, experts, jax.nn.silu, scales)

    program = jax.jit(on_mesh)
    report = {}
    for name, kernels, kernel_scales in (("float", stacks, None), ("int8", int8, scales)):
        want = experts_routed(x, *kernels, weights, experts, jax.nn.silu, scales=kernel_scales)
        got = program(x, kernels, weights, experts, kernel_scales)
        report[f"{name}_max_error"] = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    report |= _affine_errors(mesh, x, weights, experts, rng)
    report |= _act_order_errors(mesh, x, weights, experts, rng)
    hlo = program.lower(x, stacks, weights, experts, None).compile().as_text()
    report["all_reduces"] = [list(c.result_elements) for c in hlo_collectives(hlo) if c.kind == "all-reduce"]
    print(json.dumps(report))


def _by_index_on_mesh(mesh: Mesh, *args, **kwargs) -> jax.Array:
    """`experts_by_index` on `mesh`, called as `experts_routed_on_mesh` is."""
    return experts_by_index(*args, mesh=mesh, **kwargs)


def _affine_errors(mesh: Mesh, x, weights, experts, rng) -> dict[str, float]:
    """Affine 4-bit experts (values, scales and offsets `[E, in / G, out]`, groups of 8: whole
    groups on each of the 4 devices; or per channel) on the mesh, split inside each expert and
    by expert index, against one device."""
    report = {}
    shapes = [(EXPERTS, HIDDEN, FFN), (EXPERTS, HIDDEN, FFN), (EXPERTS, FFN, HIDDEN)]
    for groups in ("grouped", "channel"):
        quant = []
        for e, inputs, outputs in shapes:
            scale_shape = (e, inputs // 8, outputs) if groups == "grouped" else (e, outputs)
            quant.append(
                (
                    jnp.asarray(rng.integers(-8, 8, size=(e, inputs, outputs)), jnp.int8),
                    jnp.asarray(rng.uniform(0.01, 0.05, size=scale_shape), jnp.float32),
                    jnp.asarray(rng.uniform(-0.1, 0.1, size=scale_shape), jnp.float32),
                )
            )
        kernels, scales, offsets = (tuple(q[i] for q in quant) for i in range(3))
        want = experts_routed(x, *kernels, weights, experts, jax.nn.silu, scales=scales, offsets=offsets)
        for name, run in (("tp", experts_routed_on_mesh), ("ep", _by_index_on_mesh)):
            got = jax.jit(
                lambda x, k, w, ids, s, m, run=run: run(mesh, x, k, w, ids, jax.nn.silu, s, offsets=m)
            )(x, kernels, weights, experts, scales, offsets)
            report[f"affine_{groups}_{name}_max_error"] = float(
                np.abs(np.asarray(got) - np.asarray(want)).max()
            )
    return report


def _act_order_errors(mesh: Mesh, x, weights, experts, rng) -> dict[str, float]:
    """Experts whose gate/up rows are each in their expert's own order of the inputs (GPTQ
    act-order: `input_order [E, D]`), on one device, split inside each expert and by expert
    index, against the same experts with their rows in the inputs' own order."""
    shapes = [(EXPERTS, HIDDEN, FFN), (EXPERTS, HIDDEN, FFN), (EXPERTS, FFN, HIDDEN)]
    gate, up, down = (rng.normal(size=s).astype(np.float32) * 0.2 for s in shapes)
    order = np.stack([rng.permutation(HIDDEN) for _ in range(EXPERTS)]).astype(np.int32)
    # row r of expert e weighs input order[e, r]
    gate_rows, up_rows = (jnp.asarray(np.take_along_axis(k, order[:, :, None], axis=1)) for k in (gate, up))
    kernels = (gate_rows, up_rows, jnp.asarray(down))
    want = np.asarray(experts_routed(x, *map(jnp.asarray, (gate, up, down)), weights, experts, jax.nn.silu))
    got = {"one": experts_routed(x, *kernels, weights, experts, jax.nn.silu, input_order=jnp.asarray(order))}
    for name, run in (("tp", experts_routed_on_mesh), ("ep", _by_index_on_mesh)):
        got[name] = jax.jit(
            lambda x, k, w, ids, o, run=run: run(mesh, x, k, w, ids, jax.nn.silu, input_order=o)
        )(x, kernels, weights, experts, jnp.asarray(order))
    errors = {name: float(np.abs(np.asarray(y) - want).max()) for name, y in got.items()}
    return {f"act_order_{name}_max_error": error for name, error in errors.items()}


if __name__ == "__main__":
    main()
