# SPDX-License-Identifier: Apache-2.0
"""Each private JAX/Flax internal of `tpu_platform.internals`, taken away as a release might: the
public fallback gives the same results, and exactly one warning names what is missing."""

import dataclasses
import logging
import os
import random
import types

import flax.nnx.graphlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.interpreters import pxla
from jax._src.lib import _jax, xla_client

from tpu_platform import internals
from tpu_platform.dispatch import FlatCall
from tpu_platform.programs import (
    ExecutableCache,
    Programs,
    ProgramSpec,
    enable_persistent_cache,
    structure_text,
)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    internals.warn_fallback.cache_clear()
    yield
    internals.warn_fallback.cache_clear()


def _fallback_warnings(caplog, internal: str) -> int:
    return sum(
        r.levelno == logging.WARNING and internal in r.getMessage() and "private internal" in r.getMessage()
        for r in caplog.records
    )


def _step(weights, unused, packed):  # the second argument is dropped by the compiler
    return weights * packed.sum(), weights + 1


_WEIGHTS = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
_PACKED = np.arange(4, dtype=np.float32)


def _compiled():
    return jax.jit(_step).trace(_WEIGHTS, _WEIGHTS, _PACKED).lower().compile()


def _check_flat_call(flat: FlatCall) -> None:
    """`flat` computes what the compiled program does, with a transferred argument."""
    assert flat is not None
    for _ in range(2):
        outputs = flat([_WEIGHTS, _WEIGHTS, flat.put(2, _PACKED)])
        np.testing.assert_array_equal(outputs[0], np.asarray(_WEIGHTS) * _PACKED.sum())
        np.testing.assert_array_equal(outputs[1], np.asarray(_WEIGHTS) + 1)


def test_without_the_batched_transfer_inputs_go_through_device_put(monkeypatch, caplog):
    flat = FlatCall.of(_compiled(), 3)
    # Taken from our view of JAX's client only: `jax.device_put` itself calls it in this JAX.
    client = types.SimpleNamespace(**{k: v for k, v in vars(xla_client).items() if k != "batched_device_put"})
    monkeypatch.setattr(internals, "_xla_client", lambda: client)
    with caplog.at_level(logging.WARNING):
        _check_flat_call(flat)  # two transfers
    assert _fallback_warnings(caplog, "batched_device_put") == 1


def test_without_the_executable_in_shardings_the_public_input_shardings_serve(monkeypatch, caplog):
    compiled = _compiled()
    public = compiled.input_shardings  # in this JAX the property reads the internal itself
    with caplog.at_level(logging.WARNING), monkeypatch.context() as patch:
        patch.delattr(pxla.MeshExecutable, "_in_shardings")
        patch.setattr(type(compiled), "input_shardings", property(lambda self: public))
        flat = FlatCall.of(compiled, 3)
        again = FlatCall.of(compiled, 3)
    _check_flat_call(flat)
    _check_flat_call(again)
    assert _fallback_warnings(caplog, "_in_shardings") == 1


def test_without_the_device_assignment_one_device_shardings_use_addressable_devices(monkeypatch, caplog):
    compiled = _compiled()
    with caplog.at_level(logging.WARNING), monkeypatch.context() as patch:
        patch.delattr(_jax.Sharding, "_addressable_device_assignment")
        for sharding in jax.tree.leaves(compiled.input_shardings):  # a cached copy in the instance
            patch.delattr(sharding, "_addressable_device_assignment", raising=False)
        flat = FlatCall.of(compiled, 3)
        FlatCall.of(compiled, 3)
    _check_flat_call(flat)  # JAX's own transfers need the internal back
    assert _fallback_warnings(caplog, "_addressable_device_assignment") == 1


@pytest.mark.parametrize(
    ("owner", "name"),
    [(_jax.ExecuteResults, "consume_with_handlers"), (_jax.LoadedExecutable, "execute_sharded")],
)
def test_without_the_direct_execute_jax_calls_the_program(monkeypatch, caplog, owner, name):
    compiled = _compiled()
    with caplog.at_level(logging.WARNING), monkeypatch.context() as patch:
        patch.delattr(owner, name)
        assert FlatCall.of(compiled, 3) is None and FlatCall.of(compiled, 3) is None
    # What the runner then calls (JAX's own call needs the internal back in this JAX).
    scaled, shifted = compiled(_WEIGHTS, _WEIGHTS, _PACKED)
    np.testing.assert_array_equal(scaled, np.asarray(_WEIGHTS) * _PACKED.sum())
    np.testing.assert_array_equal(shifted, np.asarray(_WEIGHTS) + 1)
    assert _fallback_warnings(caplog, "execute_sharded(...).consume_with_handlers") == 1


def test_without_the_compiled_programs_parts_jax_calls_the_program(monkeypatch, caplog):
    compiled = _compiled()
    monkeypatch.delattr(pxla.MeshExecutable, "unsafe_call")
    with caplog.at_level(logging.WARNING):
        assert FlatCall.of(compiled, 3) is None and FlatCall.of(compiled, 3) is None
    assert _fallback_warnings(caplog, "unsafe_call") == 1


_TEMPERATURE = 1.0 + random.random()  # programs no JAX cache has seen


def _spec(rows: int) -> ProgramSpec:
    return ProgramSpec(
        key=("scaled", rows),
        jitted=jax.jit(lambda x, *, t: jnp.tanh(x / t), static_argnames="t"),
        args=(jax.ShapeDtypeStruct((rows, 4), jnp.float32),),
        static={"t": _TEMPERATURE},
    )


def test_without_the_compile_event_the_executable_cache_still_stores(monkeypatch, caplog, tmp_path):
    """A renamed JAX event must not silently stop the executable cache from storing."""
    enable_persistent_cache(os.environ["VLLM_XLA_CACHE_DIR"])
    monkeypatch.setattr(internals, "FRESH_COMPILE_EVENT", "/jax/no/such/event")
    cache = ExecutableCache(str(tmp_path / "executables"), jax.devices()[0])
    with caplog.at_level(logging.WARNING):
        programs = Programs(strict=False, cache=cache)
        for rows in (2, 3):
            programs.build(_spec(rows))
            assert os.path.exists(cache.path(_spec(rows)))
    assert _fallback_warnings(caplog, "/jax/no/such/event") == 1
    reloaded = Programs(strict=False, cache=ExecutableCache(cache.directory, jax.devices()[0]))
    for rows in (2, 3):
        reloaded.build(_spec(rows))
        x = np.linspace(-1, 1, rows * 4, dtype=np.float32).reshape(rows, 4)
        np.testing.assert_allclose(
            np.asarray(reloaded.call(("scaled", rows), None, x)), np.tanh(x / _TEMPERATURE), rtol=1e-6
        )
    assert reloaded.loaded == 2


def test_without_flax_variable_def_structure_text_still_orders_metadata(monkeypatch, caplog):
    graphdef, _ = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    reordered = dataclasses.replace(
        graphdef,
        nodes=[
            dataclasses.replace(n, metadata=dict(reversed(list(n.metadata.items()))))
            if isinstance(n, flax.nnx.graphlib.VariableDef)
            else n
            for n in graphdef.nodes
        ],
    )
    assert repr(reordered) != repr(graphdef)  # the orders differ
    expected = structure_text(graphdef)
    assert structure_text(reordered) == expected
    monkeypatch.delattr(flax.nnx.graphlib, "VariableDef")
    with caplog.at_level(logging.WARNING):
        assert structure_text(reordered) == expected
        assert structure_text(graphdef) == expected
    assert _fallback_warnings(caplog, "VariableDef") == 1
