# SPDX-License-Identifier: Apache-2.0
"""GPTQ activation order (`desc_act`) on MoE experts, each expert in its own order
(`models.gptq_checkpoint` has the format and the dense layers' way).

Each expert's kernel rows are sorted by group at load by its own `g_idx` (stable: a group's
inputs in their own order), so its groups are consecutive and the expert loads into the same
`[E, in, out]` int4 stack, scales and offsets as any GPTQ expert's (`models.moe.StackedLinear`):
the grouped-expert matmul and its layouts are unchanged. What the sorted rows then read:

- gate and up read the layer's hidden state, which the router and every expert read too: the
  gate stack keeps each expert's order (`StackedLinear.input_order`, int32 `[E, D]`) and each
  tile of the routed matmul gathers its rows into its expert's order once, for both products
  (`models.moe.experts_routed`): a `[B, D]` gather per tile beside the tile's `D * F` weight
  reads. Gate's and up's orders must be equal, as GPTQ makes them (one Hessian for one input)
  and as vLLM's GPTQ MoE reads them (one `g_idx` for both); orders that differ are refused.
- down reads the product of its own expert's gate and up: instead of a gather, gate's and up's
  output columns (values, scales, zero points, a bias) are put at load in the order of down's
  sorted rows, so the product arrives in that order. Under tensor parallelism gate/up's column
  split and down's row split then cut the same positions, each device's share of the product
  being what its share of down's rows reads (on whole groups, as any GPTQ expert's).

An expert whose `g_idx` is trivial keeps its rows (gate's stack then holds `0 .. D - 1` for
it). The orders cost `4 E D` bytes a layer beside the stacks' `3 E D F / 2` (4-bit): `8 / (3 F)`
of them, under 1% from F = 267 up.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
from flax import nnx

_EXPERT = re.compile(r"\.experts\.(\d+)\.[^.]+$")  # an expert's HF layer: `...experts.{e}.<proj>`
_STACKS = ("gate_proj", "up_proj", "down_proj")  # `models.moe.Experts`


@dataclasses.dataclass(frozen=True)
class InputOrders:
    """How a GPTQ act-order checkpoint's layers load, each by HF layer name: `rows`, the order a
    layer's kernel rows are sorted into (every reordered layer); `gathered`, the orders loaded as
    `input_order` parameters (a dense layer's, an expert gate's); `columns`, the order an
    expert's gate and up outputs are put in (its down projection's rows')."""

    rows: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    gathered: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    columns: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def expert_slot(layer: str) -> int | None:
    """The expert index an HF layer name (`...experts.{e}.<proj>`) gives, None for another."""
    match = _EXPERT.search(layer)
    return int(match.group(1)) if match else None


def expert_input_orders(
    stacks: dict[str, tuple[str, int]], orders: dict[str, np.ndarray | None], modules: dict[str, nnx.Module]
) -> InputOrders:
    """The load of the experts' orders: `stacks`, each expert layer's (HF name) stack path and
    expert index; `orders`, each one's sorted row order (None: trivial); `modules`, the model's
    modules by path. Gives each gate stack with a reordered expert its `input_order` (zeros, in
    place, before loading). A ValueError naming the tensors unless gate and up share each
    expert's order, or when a reordered down projection's gate or up is not in the checkpoint."""
    slots = {slot: layer for layer, slot in stacks.items()}
    rows = {layer: order for layer, order in orders.items() if order is not None and layer in stacks}
    gathered, columns = {}, {}
    for parent in sorted({path.rsplit(".", 1)[0] for path, _ in stacks.values()}):
        gate_stack = modules[f"{parent}.gate_proj"]
        num_experts, inputs, _ = gate_stack.kernel.get_value().shape
        reordered = False
        for e in range(num_experts):
            gate, up, down = (slots.get((f"{parent}.{proj}", e)) for proj in _STACKS)
            _check_shared_order(gate, up, rows)
            reordered = reordered or gate in rows
            if down in rows:
                if gate is None or up is None:
                    raise ValueError(
                        f"GPTQ tensor {down}.g_idx reorders an expert's down projection whose gate "
                        "or up projection has no g_idx in the checkpoint: vllm-xla puts their "
                        "outputs in down's order, and needs both quantized with it"
                    )
                columns[gate] = columns[up] = rows[down]
        if reordered:
            gathered |= _gate_orders(parent, num_experts, inputs, slots, rows)
            gate_stack.input_order = nnx.Param(np.zeros((num_experts, inputs), np.int32))
    return InputOrders(rows, gathered, columns)


def _check_shared_order(gate: str | None, up: str | None, rows: dict[str, np.ndarray]) -> None:
    """A ValueError naming both unless an expert's gate and up are in one order (or neither)."""
    have = [rows[layer] for layer in (gate, up) if layer in rows]
    if not have:
        return
    if len(have) == 1 or not np.array_equal(*have):
        raise ValueError(
            f"GPTQ tensors {gate}.g_idx and {up}.g_idx order an expert's gate and up inputs "
            "differently: vllm-xla gathers an expert's inputs once for both (GPTQ gives them one "
            "order, as vLLM's GPTQ MoE reads one g_idx for both); such a checkpoint is not served"
        )


def _gate_orders(
    parent: str, num_experts: int, inputs: int, slots: dict, rows: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Every expert's gate order of the stack under `parent` (trivial ones `0 .. inputs - 1`)."""
    found = {}
    for e in range(num_experts):
        gate = slots.get((f"{parent}.gate_proj", e))
        if gate is None:
            raise ValueError(
                f"the GPTQ checkpoint reorders the inputs of experts of {parent} but has no g_idx "
                f"for expert {e}'s gate projection"
            )
        found[gate] = rows.get(gate, np.arange(inputs, dtype=np.int32))
    return found
