# SPDX-License-Identifier: Apache-2.0
"""What the dense kernel benchmarks (`dense_batch.py`, `dense_int4.py`, `dense_int8.py`,
`dense_few_rows.py`) share: a jitted chain of products over many weights, and a call's CPU time."""

from __future__ import annotations

import time

import jax


def chain(product):
    """`product(x, *arrays)` over each entry of `weights` in turn, jitted; each output feeds the
    next input through a zero so that the products run in order and none is dropped."""

    def run(x, weights):
        for arrays in weights:
            y = product(x, *arrays)
            x = x + (y[0, 0] * 0).astype(x.dtype)  # a dependency: the products run in order
        return x

    return jax.jit(run)


def cpu_seconds(program, *args) -> float:
    """The process CPU time of one call of `program`, waited for."""
    start = time.process_time()
    program(*args).block_until_ready()
    return time.process_time() - start
