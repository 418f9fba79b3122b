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
The JAX internals this takes are read in `tpu_platform.internals`, each with its fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from tpu_platform import internals


class FlatCall:
    """`call(leaves) -> output leaves` of one compiled program (see the module docstring)."""

    def __init__(self, program: internals.FlatProgram, num_args: int, devices: list[list]):
        self._program = program
        self._kept = None if len(program.kept) == num_args else program.kept  # None: all of them
        # argument index -> (aval, sharding, devices)
        self._inputs = {
            index: (aval, sharding, devs)
            for index, aval, sharding, devs in zip(
                program.kept, program.avals, program.shardings, devices, strict=True
            )
        }

    @classmethod
    def of(cls, compiled: jax.stages.Compiled, num_args: int) -> FlatCall | None:
        """The flat call of `compiled` (built for `num_args` leaves), or None when it needs JAX's."""
        if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
            return None
        program = internals.flat_program(compiled)
        if program is None:
            return None
        devices = [internals.addressable_devices(sharding) for sharding in program.shardings]
        if any(d is None for d in devices):
            return None
        return cls(program, num_args, devices)

    def put(self, index: int, value: np.ndarray) -> jax.Array:
        """Argument `index` (of those `of` was told about) from `value`, on the program's device."""
        aval, sharding, devices = self._inputs[index]
        return internals.device_put(aval, sharding, value, devices)

    def __call__(self, args: Sequence[jax.Array]) -> list[jax.Array]:
        if self._kept is not None:
            args = [args[i] for i in self._kept]
        return internals.execute(self._program, args)
