# SPDX-License-Identifier: Apache-2.0
"""Calling a compiled program on its flat device arrays, without JAX's per-call bookkeeping.

Calling a `jax.stages.Compiled` flattens the arguments, checks their tree against the compiled
one and builds a signature of every leaf (shape, dtype, sharding, layout) before it hands the
buffers to the executable. For a forward of a few hundred arguments that is a large part of the
host time of every step, for arguments that are the same arrays step after step. `FlatCall` does
only what JAX does after those checks (the path JAX itself takes when its C++ dispatch does not
apply): the kept buffers go to the loaded executable and the results are wrapped as arrays.

It is offered only for programs JAX would run that way: no effects, host callbacks, mutable
arguments or constants, and NaN/Inf checking off. The caller guarantees the arguments are device
arrays on the program's device with the leaves' shapes and dtypes it was built for, in flat order;
`put` makes one from a NumPy array (a C++ transfer, a tenth of the cost of `jax.device_put`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax._src.lib import xla_client


class FlatCall:
    """`call(leaves) -> output leaves` of one compiled program (see the module docstring)."""

    def __init__(self, executable, kept: tuple[int, ...] | None, handlers: Sequence, inputs: dict):
        self._executable = executable
        self._kept = kept  # indices of the arguments the program uses, None: all of them
        self._handlers = handlers
        self._inputs = inputs  # argument index -> (aval, sharding, devices)

    @classmethod
    def of(cls, compiled: jax.stages.Compiled, num_args: int) -> FlatCall | None:
        """The flat call of `compiled` (built for `num_args` leaves), or None when it needs JAX's."""
        if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
            return None
        params = getattr(compiled, "_params", None)
        mesh_executable = getattr(compiled, "_executable", None)
        call = getattr(mesh_executable, "unsafe_call", None)
        needed = ("xla_executable", "out_handler", "kept_var_idx", "ordered_effects", "mut")
        if params is None or call is None or not all(hasattr(call, name) for name in needed):
            return None
        if (
            call.ordered_effects
            or getattr(call, "has_unordered_effects", True)
            or getattr(call, "has_host_callbacks", True)
            or call.mut is not None
            or params.const_args
            or params.is_high
        ):
            return None
        kept = tuple(sorted(call.kept_var_idx))
        shardings = mesh_executable._in_shardings
        inputs = {
            index: (aval, sharding, list(sharding._addressable_device_assignment))
            for index, aval, sharding in zip(kept, mesh_executable.in_avals, shardings, strict=True)
        }
        return cls(
            call.xla_executable, None if len(kept) == num_args else kept, call.out_handler.handlers, inputs
        )

    def put(self, index: int, value: np.ndarray) -> jax.Array:
        """Argument `index` (of those `of` was told about) from `value`, on the program's device."""
        aval, sharding, devices = self._inputs[index]
        return xla_client.batched_device_put(aval, sharding, [value] * len(devices), devices, True)

    def __call__(self, args: Sequence[jax.Array]) -> list[jax.Array]:
        if self._kept is not None:
            args = [args[i] for i in self._kept]
        return self._executable.execute_sharded(args).consume_with_handlers(self._handlers)
