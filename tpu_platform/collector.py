# SPDX-License-Identifier: Apache-2.0
"""Python's cyclic garbage collector, paused while start-up creates many objects.

In an engine's process (vLLM, torch, JAX and the model: millions of tracked objects) a full
collection takes about 0.2 s, and creating a few thousand objects (a model's variables, a batch
of device arrays) sets one off: loading the embedded model from the weights cache spent 0.36 s of
its 0.57 s in two of them. Start-up's objects live as long as the engine, so collecting while
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
