# SPDX-License-Identifier: Apache-2.0
"""The native CPU attention (C++ through XLA FFI) against the xla reference, and its build.

The kernel runs the whole grid of ragged batches (conftest.GRID: decode, prefill, mixed,
padding rows and slots, garbage past each block table's pages, sliding window, soft cap,
float32 and bfloat16 caches, head dims 64/128/256 and a run-time one) plus larger batches that
span many work items. Tolerances: conftest.TOLERANCE.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import api, cpu
from pallas_kernels.cpu import build
from tests.pallas_kernels.conftest import GRID, Case
from tpu_platform.attention_backend import select_backend

pytestmark = pytest.mark.usefixtures("native_kernels")

# fmt: off
EXTRA = (
    # Head dim 80 takes the kernel's run-time-size path; 40 sequences make many work items.
    Case("decode_p16_d80_g3_many", (1,) * 40, tuple(range(3, 1203, 30)), 44, 16, 80, 3, 3,
         jnp.bfloat16),
    # Prefill rows split into several 16-row blocks per sequence, one sequence's window inside a block.
    Case("prefill_p16_d64_g3_blocks", (45, 17, 1), (60, 17, 300), 4, 16, 64, 3, 3,
         sliding_window=10),
    Case("mixed_p8_d128_g1_f32_cap", (3, 1, 2), (3, 99, 2), 3, 8, 128, 2, 1, soft_cap=5.0),
    # The embedded model's decode as served: 128-token pages, 3 query heads a kv head, bfloat16
    # rows and cache (VDPBF16PS scores), contexts ending mid 16-key group and past a page.
    Case("decode_p128_d64_g3_bf16_model", (1,) * 5, (1, 17, 128, 300, 700), 6, 128, 64, 3, 3,
         jnp.bfloat16, sinks=True),
)
# fmt: on


# One program a case: the fast tier keeps a cover of the grid's features (bfloat16 and float32,
# both float8 caches, window, soft cap, sinks, chunks, pages of 16, 32 and 128, head dims 64, 128
# and 512, decode, prefill and mixed batches, the empty batch) and the served decode below; the
# other cases are the slow tier's.
FAST_CASES = {
    "mixed_p16_d64_g1_bf16_window_cap", "mixed_p32_d64_g3_e5m2_window", "decode_p32_d128_g4_fp8",
    "mixed_p16_d64_g8_bf16_sinks_window", "mixed_p16_d128_g4_bf16_chunk", "mixed_p16_d512_g4_bf16",
    "prefill_p128_d64_g4_cap", "empty_batch", "decode_p128_d64_g3_bf16_model",
}  # fmt: skip


def _cover(cases: tuple[Case, ...]) -> list:
    return [pytest.param(c, id=c.name, marks=() if c.name in FAST_CASES else pytest.mark.slow) for c in cases]


@pytest.mark.parametrize("grid_case", _cover(GRID))
def test_matches_reference(grid_case, compare_with_reference):
    compare_with_reference(grid_case, "cpu_native")


@pytest.mark.parametrize("extra", _cover(EXTRA))
def test_matches_reference_on_larger_batches(extra, compare_with_reference):
    compare_with_reference(extra, "cpu_native")


def test_output_keeps_the_query_dtype_and_zeroes_padding_rows():
    q = jnp.ones((5, 2, 64), jnp.bfloat16)
    cache = cpu.allocate_kv_cache(4, 16, 1, 64, jnp.bfloat16)
    k = jnp.full((2, 1, 64), 0.5)
    cache = cpu.write_kv(cache, k, k + 1, jnp.array([16, 17], jnp.int32))  # page 1
    out = cpu.ragged_paged_attention(
        q, cache, jnp.array([2, 7], jnp.int32), jnp.array([[1, 0], [3, 3]], jnp.int32),
        jnp.array([0, 2, 2], jnp.int32), jnp.array([1], jnp.int32), sm_scale=0.1,
    )  # fmt: skip
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    np.testing.assert_array_equal(np.asarray(out[:2], np.float32), 1.5)  # both keys' value is 1.5
    np.testing.assert_array_equal(np.asarray(out[2:], np.float32), 0.0)  # rows past cu_q_lens[1]


def test_rejects_a_cache_dtype_it_cannot_read():
    args = (jnp.zeros((1, 1, 64)), jnp.zeros((2, 4, 1024), jnp.int32), *(jnp.zeros((1,), jnp.int32),) * 4)
    with pytest.raises(ValueError, match=r"reads float32, bfloat16 and float8 .* caches, not int32"):
        cpu.ragged_paged_attention(*args, sm_scale=1.0)


def test_api_rejects_tuning_and_other_platforms():
    with pytest.raises(ValueError, match="takes no tuning"):
        api.ragged_paged_attention(
            *(jnp.zeros((1,)),) * 6, sm_scale=1.0, backend="cpu_native", num_kv_pages_per_block=2
        )
    with pytest.raises(ValueError, match="runs on CPU only"):
        api.resolve_backend("cpu_native", platform="tpu")


def test_cache_is_page_major_with_each_heads_keys_then_values():
    cache = cpu.allocate_kv_cache(5, 4, 2, 8, jnp.float32)
    assert cache.shape == (5, 4, 32)
    k = jnp.arange(2 * 2 * 8, dtype=jnp.float32).reshape(2, 2, 8)  # tokens x heads x D
    cache = np.asarray(cpu.write_kv(cache, k, -k, jnp.array([13, -1], jnp.int32)))  # page 3, offset 1
    expected = np.zeros((5, 4, 32), np.float32)
    expected[3, 0:2, 8:16] = k[0]  # keys of both heads
    expected[3, 2:4, 8:16] = -k[0]  # then their values; the -1 slot writes nothing
    np.testing.assert_array_equal(cache, expected)


def test_write_is_in_place_when_the_cache_is_donated():
    cache = cpu.allocate_kv_cache(64, 16, 3, 64, jnp.bfloat16)
    pointer = cache.unsafe_buffer_pointer()
    write = jax.jit(cpu.write_kv, donate_argnums=0)
    k = jnp.ones((5, 3, 64), jnp.bfloat16)
    for slots in ([7], [1, 2, 40, 900, -1]):  # one row (the dynamic-update-slice trap), several
        slots = jnp.asarray(slots, jnp.int32)
        cache = write(cache, k[: slots.shape[0]], k[: slots.shape[0]], slots)
        assert cache.unsafe_buffer_pointer() == pointer


def test_kernel_runs_in_the_donated_step_that_writes_the_cache():
    cache = cpu.allocate_kv_cache(8, 16, 1, 64, jnp.float32)
    step = jax.jit(
        lambda c, x: (
            c2 := cpu.write_kv(c, x, 2 * x, jnp.array([35], jnp.int32)),
            cpu.ragged_paged_attention(
                x, c2, jnp.array([4], jnp.int32), jnp.array([[2, 5]], jnp.int32),
                jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32), sm_scale=1.0,
            ),
        ),
        donate_argnums=0,
    )  # fmt: skip
    x = jnp.ones((1, 1, 64))
    _, out = step(cache, x)  # slot 35 = page 2, offset 3: position 3 of the only sequence
    # Positions 0..2 (page 2, offsets 0..2) hold zeros: softmax over [0, 0, 0, 64] is ~1 on the last.
    np.testing.assert_allclose(np.asarray(out)[0, 0], 2.0, rtol=1e-6)


def test_library_is_named_for_its_sources_and_reused(native_kernels):
    # The session's build (the `native_kernels` fixture) lies under the name the current sources
    # hash to, and building into its directory again hands it back untouched.
    assert native_kernels.name == build.library_name(build.find_compiler())
    stamp = native_kernels.stat().st_mtime_ns
    assert build.build_library(native_kernels.parent) == native_kernels
    assert native_kernels.stat().st_mtime_ns == stamp  # reused, not rebuilt


@pytest.mark.parametrize("edited_file", [path.name for path in (*build.SOURCES, *build.HEADERS)])
def test_library_name_follows_every_source(tmp_path, monkeypatch, edited_file):
    compiler = build.find_compiler()
    first = build.library_name(compiler)
    edited = tmp_path / edited_file
    group = "HEADERS" if edited_file.endswith(".h") else "SOURCES"
    files = getattr(build, group)
    edited.write_text(next(f for f in files if f.name == edited_file).read_text() + "\n// edited\n")
    monkeypatch.setattr(build, group, tuple(edited if f.name == edited_file else f for f in files))
    assert build.library_name(compiler) != first


def test_build_errors_name_the_cause(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(build.NativeKernelError, match=r"no C\+\+ compiler found.*no-such-compiler.*'xla'"):
        build.build_library(tmp_path)
    monkeypatch.delenv("CXX")
    sources = [source.name for source in build.SOURCES]
    assert sources == [
        "paged_attention.cc", "rope_kv.cc", "silu_mul.cc", "rms_norm.cc", "dense.cc", "dense_f32.cc",
        "dense_int8.cc", "dense_int4.cc",
    ]  # fmt: skip
    # One good and one broken source, side by side as the kernels build (the real sources take
    # the compiler tens of seconds): the error names what was built and quotes the failing command.
    good, broken = tmp_path / "good.cc", tmp_path / "broken.cc"
    good.write_text("int vllm_xla_good() { return 1; }\n")
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCES", (good, broken))
    failed = r"building good\.cc broken\.cc failed \([^)]*broken\.cc"
    with pytest.raises(build.NativeKernelError, match=failed):
        build.build_library(tmp_path / "out")


def test_concurrent_builders_of_one_directory_compile_once(tmp_path, monkeypatch):
    compiled = []

    def slow_compile(compiler, library):
        compiled.append(library)
        time.sleep(0.3)  # long enough for the other builder to arrive while this one holds the lock
        library.write_bytes(b"library")

    monkeypatch.setattr(build, "_compile", slow_compile)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        libraries = list(pool.map(lambda _: build.build_library(tmp_path), range(3)))
    assert len(compiled) == 1 and libraries == [compiled[0]] * 3


def test_build_module_prints_the_library_or_the_error(native_kernels, tmp_path, monkeypatch, capsys):
    from pallas_kernels.cpu.__main__ import main

    assert main([str(native_kernels.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(native_kernels)
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert main([str(tmp_path)]) == 1
    assert "no C++ compiler found" in capsys.readouterr().err


def test_select_backend_falls_back_to_xla_only_when_asked_for_auto(tmp_path, monkeypatch, caplog):
    built = os.environ["VLLM_XLA_CACHE_DIR"]  # where the `native_kernels` fixture built them
    assert select_backend("auto", "cpu", built) == "cpu_native"
    assert select_backend("xla", "cpu", built) == "xla"
    monkeypatch.setenv("CXX", "no-such-compiler")
    fresh = tmp_path / "fresh"
    with caplog.at_level(logging.WARNING):
        assert select_backend("auto", "cpu", str(fresh)) == "xla"
    assert "using the slower 'xla' backend" in caplog.text and "no-such-compiler" in caplog.text
    with pytest.raises(build.NativeKernelError):
        select_backend("cpu_native", "cpu", str(fresh))
    with pytest.raises(ValueError, match="runs on CPU only"):
        select_backend("cpu_native", "tpu", str(fresh))
