# SPDX-License-Identifier: Apache-2.0
"""Python's cyclic garbage collector, paused while start-up creates many objects.

In an engine's process (vLLM, torch, JAX and the model: millions of tracked objects) a full
collection is slow, and creating a few thousand objects (a model's variables, a batch of device
arrays) sets one off: profiled, such collections took most of a model load from the weights
cache. Start-up's objects live as long as the engine, so collecting while
they are made finds nothing to free.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside (on again afterwards only if it was on)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
