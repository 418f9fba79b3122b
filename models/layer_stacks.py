# SPDX-License-Identifier: Apache-2.0
"""Identical layers' weights as one `[L, ...]` array each: fewer arguments to the step program.

The runtime's execute call costs some time per argument array, and a decoder passes several
for each of its layers. `stack_layer_weights` gives every projection of a decoder's layers that
runs on the native CPU dense kernel (a `PackedKernel`: the same shape and format in every layer)
one stack shared by all of them (one nnx Variable, so one leaf of the model's state); each
Linear keeps its `layer_index` and the kernel reads that layer of the stack in place
(`pallas_kernels.cpu.native_dense(..., layer=)`: no copy of its weights). Scales and offsets of
int8 and int4 kernels are stacked beside them, read alike. Norm weights are stacked too, their
layer sliced by XLA (a copy of a few hundred values). A projection some layer lacks, or holds in
another shape or format, keeps its per-layer arrays.
"""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import RMSNorm
from models.linear import Linear, PackedKernel

_LINEAR_PARTS = ("kernel", "kernel_scale", "kernel_offset")


def stack_layer_weights(model: nnx.Module) -> int:
    """Stacks `model`'s per-layer packed kernels (with their scales and offsets) and norm
    weights, layer by layer of every list of layers (module docstring); returns how many
    stacks. Run after packing (`pack_for_native_dense`) on one device (a tensor-parallel
    split places each layer's weights by name, so it keeps them per layer)."""
    groups, layers = _groups(model)
    whole = [
        sorted(members, key=lambda member: member[0])
        for (prefix, _), members in groups.items()
        if len(members) == layers[prefix] and _uniform([module for _, module in members])
    ]
    if not any(isinstance(members[0][1], Linear) for members in whole):
        return 0  # no packed kernels (XLA's dots, as on TPU and GPU): the program stays as it is
    stacks = 0
    for members in whole:
        modules = [module for _, module in members]
        parts = _LINEAR_PARTS if isinstance(modules[0], Linear) else ("weight",)
        for part in parts:
            first = getattr(modules[0], part)
            if first is None:
                continue
            stack = type(first)(_stacked([getattr(m, part).get_value() for m in modules]))
            for module in modules:
                setattr(module, part, stack)  # one Variable shared: one leaf of the state
            stacks += 1
        for index, module in enumerate(modules):
            module.layer_index = index  # static (graph) data: which layer of the stacks
    return stacks


def _stacked(values: list):
    """The layers' values as one `[L, ...]` array (abstract ones, as the planner has, abstract)."""
    first = values[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(values), *first.shape), first.dtype)
    return jnp.stack(values)


def _groups(model: nnx.Module) -> tuple[dict, dict]:
    """The stackable modules by (list of layers, path inside a layer): [(layer, module)]; and each
    list's number of layers."""
    groups: dict[tuple, list] = defaultdict(list)
    layers: dict[tuple, int] = defaultdict(int)
    for path, module in nnx.iter_modules(model):
        at = next((i for i, name in enumerate(path) if isinstance(name, int)), None)
        if at is None:
            continue
        prefix = tuple(path[:at])
        layers[prefix] = max(layers[prefix], path[at] + 1)
        if _stackable(module):
            groups[(prefix, tuple(path[at + 1 :]))].append((path[at], module))
    return groups, layers


def _stackable(module: nnx.Module) -> bool:
    if getattr(module, "layer_index", None) is not None:
        return False
    if isinstance(module, RMSNorm):
        return True
    return (
        isinstance(module, Linear) and isinstance(module.kernel, PackedKernel) and module.input_order is None
    )


def _uniform(modules: list[nnx.Module]) -> bool:
    """Whether every module holds its stacked parts in one type, shape and dtype."""
    parts = _LINEAR_PARTS if isinstance(modules[0], Linear) else ("weight",)
    for part in parts:
        kinds = {_kind(getattr(module, part)) for module in modules}
        if len(kinds) != 1:
            return False
    return True


def _kind(variable) -> tuple | None:
    if variable is None:
        return None
    value = variable.get_value()
    return type(variable), tuple(value.shape), jnp.dtype(value.dtype).name
