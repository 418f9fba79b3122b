# SPDX-License-Identifier: Apache-2.0
"""CPU time of the calling thread in one call of a compiled program, by argument count and by
kernel count: what the runner's `execute calls` phase (`host_cpu_time.py`) is made of.

    .venv/bin/python benchmarks/call_cost.py [--reps 300]

Each program is called as the runner calls its forward (`tpu_platform.dispatch.FlatCall`: the
executable on its flat device arrays, JAX's own call shown beside it) and timed with
`time.thread_time` around the call alone; the results are waited for outside the timing.
- arguments: a program summing N small arrays (one fused kernel), for N up to the forward's ~190;
- kernels: a chain of K `tanh(x @ w)` layers (one argument a layer, so N = K + 1) at two widths,
  to tell a cost per kernel from a cost per unit of work. Its inputs are ready when it is called,
  so XLA:CPU's thunk executor starts the kernels on the calling thread: this part is the
  program's work, which the runner's steady decode steps do not show (their call returns after
  the launch).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def _time_calls(call, args: list, reps: int) -> float:
    """Calling-thread CPU microseconds a call of `call(args)`, each call's results waited for."""
    for _ in range(5):
        call(args)[0].block_until_ready()
    spent = 0.0
    for _ in range(reps):
        start = time.thread_time()
        outputs = call(args)
        spent += time.thread_time() - start
        outputs[0].block_until_ready()
    return 1e6 * spent / reps


def _costs(function, args: list, reps: int) -> tuple[float, float]:
    """(flat call, JAX's call) microseconds of the compiled `function` on `args`."""
    import jax

    from tpu_platform.dispatch import FlatCall

    compiled = jax.jit(function).lower(*args).compile()
    flat = FlatCall.of(compiled, len(args))
    return _time_calls(flat, args, reps), _time_calls(lambda a: compiled(*a), args, reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp

    def total(*xs):
        return (sum(x[:4] for x in xs),)

    print("arguments (one fused kernel): flat call / JAX's call, calling thread's CPU us")
    for n in (2, 16, 64, 128, 192, 256):
        flat, own = _costs(total, [jnp.full(64, i, jnp.float32) for i in range(n)], args.reps)
        print(f"  {n:4d} arguments: {flat:7.1f} / {own:7.1f}")

    def chain(x, *ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return (x,)

    print("kernels (a chain of tanh(x @ w), 64 rows): flat call / JAX's call, calling thread's CPU us")
    for width in (64, 256):
        for layers in (10, 50, 100):
            weights = [jnp.eye(width, dtype=jnp.float32) for _ in range(layers)]
            flat, own = _costs(chain, [jnp.ones((64, width), jnp.float32), *weights], args.reps)
            print(f"  {layers:4d} layers of width {width}: {flat:7.1f} / {own:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
