# SPDX-License-Identifier: Apache-2.0
"""What a compiled program needs and costs: `ProgramFacts` (XLA's memory and cost analyses, the
compile time and the optimized HLO's traffic and collectives), read from a `jax.stages.Compiled`
(`program_facts`) or from a compile that `measured` times; a compile the target's compiler refuses
for the chip's memory is `ProgramTooLarge`, with the bytes it asked for."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from tpu_platform.planner.hlo import Collective, Traffic, hlo_collectives, hlo_traffic, summarize_collectives


@dataclasses.dataclass(frozen=True, slots=True)
class ProgramFacts:
    """One compiled program: XLA's memory analysis (bytes per chip), its cost analysis (its
    model of the program, not a measurement) and the seconds lowering and compiling took."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse a donated argument's buffer (the KV caches)
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    optimal_seconds: float | None  # XLA's own time estimate; negative on TPU with Mosaic calls
    compile_seconds: float
    traffic: Traffic  # bytes the optimized HLO's instructions move (`hlo`)
    collectives: tuple[Collective, ...] = ()  # the cross-chip exchanges of a sharded program

    @property
    def peak_bytes(self) -> int:
        """Memory the program needs while it runs: arguments, outputs not aliasing a donated
        argument, temporaries and its code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    def as_dict(self) -> dict[str, Any]:
        facts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        facts.update(traffic=self.traffic.as_dict(), collectives=summarize_collectives(self.collectives))
        return {**facts, "peak_bytes": self.peak_bytes}


def program_facts(compiled: jax.stages.Compiled, compile_seconds: float) -> ProgramFacts:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list | tuple):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    optimal = cost.get("optimal_seconds")
    text = compiled.as_text()
    return ProgramFacts(
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        optimal_seconds=None if optimal is None else float(optimal),
        compile_seconds=compile_seconds,
        traffic=hlo_traffic(text),
        collectives=tuple(hlo_collectives(text)),
    )


def compile_with_text(jitted: Any, device: jax.Device, *args: Any, **static: Any) -> jax.stages.Compiled:
    """The compiled program (its `as_text()` holds the optimized HLO), for a closer look."""
    with jax.default_device(device):  # the Pallas backends lower for the target's platform
        return jitted.trace(*args, **static).lower().compile()


class ProgramTooLarge(Exception):
    """The target's compiler refused the program: it needs more memory than the chip has."""

    def __init__(self, message: str, needed_bytes: int):
        super().__init__(message)
        self.needed_bytes = needed_bytes


# XLA's TPU compiler: "... the total memory required for HLO temporaries (40.46G) exceeds
# available HBM (31.25G)".
_OUT_OF_MEMORY = re.compile(r"Ran out of memory.*?required[^(]*\(([\d.]+)([KMGT]?)\)", re.S)


def measured(compile_program: Callable[[], jax.stages.Compiled]) -> ProgramFacts:
    """The facts of the program `compile_program` compiles, or `ProgramTooLarge` when the target's
    compiler refuses it for the chip's memory."""
    start = time.perf_counter()
    try:
        compiled = compile_program()
    except jax.errors.JaxRuntimeError as error:
        found = _OUT_OF_MEMORY.search(str(error))
        if found is None:
            raise
        number, unit = found.groups()
        scale = 1 << (10 * "_KMGT".index(unit or "_")) if unit else 1
        raise ProgramTooLarge(str(error).splitlines()[0], int(float(number) * scale)) from error
    return program_facts(compiled, time.perf_counter() - start)
