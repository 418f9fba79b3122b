# SPDX-License-Identifier: Apache-2.0
"""The per-token LoRA product (`models.lora`): every token gets its own adapter's update, checked
against NumPy for mixes of slots and step widths that tile differently; the tiles hold one
slot's tokens each and no token without an adapter; a non-finite slot stays in its own tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.linear import Linear
from models.lora import LoraWeights, lora_tokens, set_lora_tokens

SLOTS = 5  # max_loras = 4, slot 0 for no adapter
D_IN, D_OUT, RANK = 12, 10, 6


def _linear(seed: int, nan_slot: int | None = None, nan_in: str = "ab") -> Linear:
    """A Linear with random adapters in slots 1..4 (slot 0 zeros); `nan_slot`'s `a` and/or `b`
    (`nan_in`) all NaN."""
    rng = np.random.default_rng(seed)
    linear = Linear(D_IN, D_OUT, bias=False, dtype=jnp.float32)
    linear.kernel.set_value(rng.normal(size=(D_IN, D_OUT)).astype(np.float32))
    a = rng.normal(size=(SLOTS, D_IN, RANK)).astype(np.float32)
    b = rng.normal(size=(SLOTS, RANK, D_OUT)).astype(np.float32)
    a[0] = b[0] = 0
    if nan_slot is not None:
        for name, array in (("a", a), ("b", b)):
            if name in nan_in:
                array[nan_slot] = np.nan
    linear.lora = LoraWeights(a, b)
    return linear


def _reference(linear: Linear, x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Token by token in float64: `x @ W + (x @ A[slot]) @ B[slot]`, `x @ W` for slot 0."""
    kernel = np.asarray(linear.kernel[...], np.float64)
    a, b = (np.asarray(v[...], np.float64) for v in (linear.lora.a, linear.lora.b))
    rows = []
    for t, slot in enumerate(slots):
        row = x[t] @ kernel
        rows.append(row + (x[t] @ a[slot]) @ b[slot] if slot else row)
    return np.stack(rows)


def _product(linear: Linear, x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    set_lora_tokens(linear, jnp.asarray(slots, jnp.int32))
    return np.asarray(linear.product(jnp.asarray(x)))


def _slot_patterns():
    rng = np.random.default_rng(3)
    return {
        "one decode token": np.array([3]),
        "base rows only": np.zeros(9, np.int64),
        "mixed, 64 tokens": rng.integers(0, SLOTS, 64),
        "slots 2 and 4 unused": rng.choice([0, 1, 3], 40),
        "mixed, 200 tokens": rng.integers(0, SLOTS, 200),
        "skewed: one token of slot 4 among slot 1": np.array([1] * 30 + [4] + [1] * 5 + [0] * 4),
    }


# One program a pattern: the fast tier keeps a mixed batch and the skewed one.
_FAST_PATTERNS = ("mixed, 64 tokens", "skewed: one token of slot 4 among slot 1")


@pytest.mark.parametrize(
    "name", [n if n in _FAST_PATTERNS else pytest.param(n, marks=pytest.mark.slow) for n in _slot_patterns()]
)
def test_each_token_gets_its_own_adapters_update(name):
    slots = _slot_patterns()[name]
    linear = _linear(seed=len(slots))
    x = np.random.default_rng(1).normal(size=(slots.size, D_IN)).astype(np.float32)
    np.testing.assert_allclose(_product(linear, x, slots), _reference(linear, x, slots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(_slot_patterns()))
def test_tiles_hold_one_slots_tokens_each_and_no_base_token(name):
    """What makes the product per token: each tile's rows are tokens of the tile's slot (or
    empty), every token with an adapter is in exactly one row, and none without one."""
    slots = _slot_patterns()[name]
    tokens = jax.tree.map(np.asarray, lora_tokens(jnp.asarray(slots, jnp.int32), SLOTS))
    t = slots.size
    tiles = tokens.tile_tokens.reshape(-1, tokens.rows)
    assert tiles.shape[0] == tokens.tile_slots.size
    for tile, slot in zip(tiles, tokens.tile_slots, strict=True):
        real = tile[tile < t]
        assert (slots[real] == slot).all() and slot > 0
    with_adapter = np.flatnonzero(slots > 0)
    np.testing.assert_array_equal(np.sort(tokens.tile_tokens[tokens.tile_tokens < t]), with_adapter)
    np.testing.assert_array_equal(tokens.tile_tokens[tokens.token_rows[with_adapter]], with_adapter)
    assert tokens.any_adapter == (with_adapter.size > 0)
    # the rows multiplied: each slot in use wastes under one tile
    assert tokens.tile_tokens.size <= t + min(SLOTS - 1, t) * (tokens.rows - 1)


@pytest.mark.parametrize("nan_in", ["a", pytest.param("b", marks=pytest.mark.slow)])
def test_a_nan_slot_reaches_only_its_own_tokens(nan_in):
    """Slot 2 all NaN (in A or in B): tokens without an adapter and other adapters' tokens
    equal the reference (finite); only slot 2's own tokens are NaN."""
    slots = np.array([0, 2, 1, 3, 0, 2, 4, 1, 0, 3, 2, 4, 0])
    linear = _linear(seed=7, nan_slot=2, nan_in=nan_in)
    x = np.random.default_rng(2).normal(size=(slots.size, D_IN)).astype(np.float32)
    got = _product(linear, x, slots)
    want = _reference(linear, x, slots)
    own = slots == 2
    assert np.isnan(got[own]).all()
    assert np.isfinite(got[~own]).all()
    np.testing.assert_allclose(got[~own], want[~own], rtol=1e-4, atol=1e-4)
    base = _product(linear, x, np.zeros_like(slots))  # a step without adapters
    np.testing.assert_allclose(base, x @ np.asarray(linear.kernel[...]), rtol=1e-5, atol=1e-5)
