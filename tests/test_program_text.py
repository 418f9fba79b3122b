# SPDX-License-Identifier: Apache-2.0
"""`tests.program_text.canonical_program_text` against programs JAX lowers: the same computation
whether a helper's call sites share one private function or each has a copy, a different one
whenever a function's body differs; symbols that are not functions left as they are."""

import jax
import jax.numpy as jnp

from tests.program_text import canonical_program_text


def _helper(scale: float):
    def helper(x):
        return jnp.where(x > 0, x * scale, x)

    return jax.jit(helper)  # each call a new jitted function: its own private function when lowered


def _lowered(*helpers) -> str:
    def program(x):
        y = x
        for helper in helpers:
            y = helper(y)
        return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct(y.shape, y.dtype), y)

    return jax.jit(program).lower(jnp.ones(4)).as_text()


def test_copies_of_one_function_are_the_program_that_calls_one_twice():
    shared = _helper(2.0)
    once, copies = _lowered(shared, shared), _lowered(_helper(2.0), _helper(2.0))
    assert once != copies  # JAX prints the copies under two names
    assert "@helper_0(" in copies and "@helper_0(" not in once
    assert canonical_program_text(once) == canonical_program_text(copies)


def test_a_function_that_computes_otherwise_is_another_program():
    same, other = _lowered(_helper(2.0), _helper(2.0)), _lowered(_helper(2.0), _helper(3.0))
    assert canonical_program_text(same) != canonical_program_text(other)
    swapped = _lowered(_helper(3.0), _helper(2.0))  # the same functions called in the other order
    assert canonical_program_text(other) != canonical_program_text(swapped)


def test_only_functions_are_renamed():
    text = canonical_program_text(_lowered(_helper(2.0)))
    assert "@main(" in text and "@xla_ffi_python_cpu_callback(" in text  # a custom call's target
    assert "@helper." in text and "@helper(" not in text
    assert canonical_program_text(text) == text  # canonical names stay as they are
