# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/perplexity.py`'s forced-x_bits configurations run only with prefill chunks the int4
kernel's few-row path takes: past `X_BITS_ROWS_AT_MOST` rows the kernel gives x_bits 8 and 16 the
same product (checked on the kernel itself), so a larger chunk measured the as-shipped model
under the configurations' names."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from tests.benchmark_scripts import load_benchmark

perplexity = load_benchmark("perplexity")
FEW_ROWS = perplexity.X_BITS_ROWS_AT_MOST


def test_a_chunk_past_the_few_row_path_leaves_the_x_bits_configurations_out():
    chosen = perplexity.chosen_configs(None, 512)
    assert not chosen & set(perplexity.X_BITS)
    assert chosen == set(perplexity.CONFIGS) - set(perplexity.X_BITS)
    assert perplexity.chosen_configs(None, FEW_ROWS) == set(perplexity.CONFIGS)


def test_x_bits_configurations_named_with_a_large_chunk_are_refused():
    with pytest.raises(ValueError, match=r"q4_1_x8.*--chunk 512.*--chunk 16"):
        perplexity.chosen_configs(["q4_1_x8", "fp8_online"], 512)
    assert perplexity.chosen_configs(["q4_1_x8"], 16) == {"q4_1_x8", perplexity.REFERENCE}


@pytest.mark.parametrize(("rows", "same"), [(FEW_ROWS, False), (FEW_ROWS + 1, True)])
def test_x_bits_reaches_the_kernel_up_to_the_few_row_bound(native_kernels, rows, same):
    """The kernel's own limit behind `X_BITS_ROWS_AT_MOST`: one plane and two differ at that many
    rows (the one plane's coarser rounding) and are the same product one row more."""
    if "avx512_vnni" not in cpu.dense_int4_isas(native_kernels):
        pytest.skip("this CPU (or its kernel) has no AVX-512 VNNI: x_bits reaches no path")
    rng = np.random.default_rng(3)
    q = rng.integers(-8, 8, (256, 32)).astype(np.int8)
    scale = jnp.asarray(rng.random((8, 32)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    packed = cpu.pack_dense_kernel_int4(q)
    one_plane = np.asarray(cpu.native_dense_int4(x, packed, scale, x_bits=8))
    two_planes = np.asarray(cpu.native_dense_int4(x, packed, scale, x_bits=16))
    exact = np.asarray(x, np.float64) @ (q * np.repeat(np.asarray(scale, np.float64), 32, axis=0))
    np.testing.assert_allclose(one_plane, exact, rtol=0.05, atol=0.05 * np.abs(exact).max())
    assert np.array_equal(one_plane, two_planes) == same
