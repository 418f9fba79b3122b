# SPDX-License-Identifier: Apache-2.0
"""Two lowered programs compared as programs, not as JAX happened to print them.

JAX lowers a jitted helper (`jnp.where`'s `_where`, a model's inner functions) to a private
function and calls it from each place it is used; a call site whose traced helper came out of
JAX's caches as another object than the first gets a copy of the same function under a new name
(`_where_67` beside `_where_66`). Which call sites share a function thus depends on what the
caches held while tracing, and a full run saw the planner's and the runner's texts of one program
differ only so. `canonical_program_text` names each private function by its body (the callee names
in it canonical too) and keeps one copy of each body, so two texts are equal exactly when they
compute the same thing with the same operations in the same order.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

_FUNCTION = re.compile(r"^  func\.func (?:public |private )?@([\w$.-]+)\(")
# What JAX appends to tell copies apart (`_where_66`), or a name this module gave already.
_NUMBERED = re.compile(r"(_[0-9]+|\.[0-9a-f]{16})$")


def program_text(lowered: Any) -> str:
    """A `jax.stages.Lowered` program's text, canonical (`canonical_program_text`)."""
    return canonical_program_text(lowered.as_text())


def canonical_program_text(text: str) -> str:
    """`text` (a module's `Lowered.as_text()`) with its private functions named by their bodies,
    each body once, in the order of those names; everything else as it was."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _FUNCTION.match(line)]
    if not starts:
        return text
    end = max(i for i, line in enumerate(lines) if line == "}")  # the module's closing brace
    blocks = {
        _FUNCTION.match(lines[start]).group(1): "\n".join(lines[start:stop])
        for start, stop in zip(starts, [*starts[1:], end], strict=True)
    }
    reference = re.compile(
        r"@(" + "|".join(map(re.escape, sorted(blocks, key=len, reverse=True))) + r")(?![\w$.-])"
    )
    names: dict[str, str] = {}

    def body(name: str) -> str:  # the block with every function it names canonical, itself as `@self`
        return reference.sub(
            lambda m: "@self" if m.group(1) == name else "@" + canonical(m.group(1)), blocks[name]
        )

    def canonical(name: str) -> str:
        if name not in names:
            if name == "main":
                names[name] = name
            else:
                digest = hashlib.sha256(body(name).encode()).hexdigest()[:16]
                names[name] = f"{_NUMBERED.sub('', name)}.{digest}"
        return names[name]

    definitions = {canonical(name): body(name).replace("@self", "@" + canonical(name), 1) for name in blocks}
    main = [name for name in definitions if name == "main"]
    ordered = main + sorted(name for name in definitions if name != "main")
    return "\n".join([*lines[: starts[0]], *(definitions[name] for name in ordered), *lines[end:]])
