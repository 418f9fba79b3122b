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
`put` makes one from a NumPy array (a C++ transfer, a tenth of the cost of `jax.device_put`), and
`HostViews` keeps the arrays that are views of reused host buffers, so those cost no transfer at
all after their first step. The JAX internals this takes are read in `tpu_platform.internals`,
each with its fallback.
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

    def input_key(self, index: int) -> tuple:
        """What an array passed as argument `index` must match: its abstract value and sharding."""
        aval, sharding, _ = self._inputs[index]
        return aval, sharding

    def __call__(self, args: Sequence[jax.Array]) -> list[jax.Array]:
        if self._kept is not None:
            args = [args[i] for i in self._kept]
        return internals.execute(self._program, args)


class HostViews:
    """Device arrays that are views of host buffers the caller reuses, made once per buffer.

    On XLA:CPU a transferred 64-byte-aligned NumPy buffer is not copied: the device array reads
    the host memory in place. Such an array stays valid for every later write to its buffer, so
    a caller that rewrites a buffer only once the steps reading it have finished (as
    `inputs.StepBuffers` does) can pass the same array again and skip the transfer. Where the
    transfer did copy (another platform, a buffer of several devices, an unaligned one) the
    buffer is transferred again at each call, as `FlatCall.put` alone does.
    """

    def __init__(self) -> None:
        # id(buffer) -> (the buffer, kept alive so its id is not reused; the program input it
        # was made for; its device array)
        self._views: dict[int, tuple[np.ndarray, tuple, jax.Array]] = {}

    def put(self, call: FlatCall, index: int, value: np.ndarray) -> jax.Array:
        """`call.put(index, value)`, or the view of `value` made for the same input before."""
        kept = self._views.get(id(value))
        key = call.input_key(index)
        if kept is not None and kept[0] is value and kept[1] == key:
            return kept[2]
        array = call.put(index, value)
        if _is_view(array, value):
            self._views[id(value)] = (value, key, array)
        return array

    def __len__(self) -> int:
        return len(self._views)


def _is_view(array: jax.Array, value: np.ndarray) -> bool:
    """Whether `array` is one CPU device's buffer reading `value`'s memory in place (an
    accelerator's buffer pointer is in its own memory: never a view)."""
    devices = array.sharding.device_set
    if len(devices) != 1 or next(iter(devices)).platform != "cpu" or value.size == 0:
        return False
    try:
        return array.unsafe_buffer_pointer() == value.ctypes.data
    except Exception:  # a platform whose buffers have no host pointer: a copy
        return False
