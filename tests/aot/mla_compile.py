# SPDX-License-Identifier: Apache-2.0
"""Worker: compiles a layer's latent attention (MLA) step, the latent write then the kernel, for
compile-only TPU or GPU targets at DeepSeek's shapes; prints one JSON line.

`python -m tests.aot.mla_compile tpu|cuda [target/case ...]` (no pairs: the platform's whole
plan), run by `toolchains.run_worker`. The answer maps `"<target>/<case>"` to the compile's
outcome as `compile_kernels` reports it (seconds, `memory_analysis()` bytes, whether the
kernel's custom call is in the compiled program, or the compiler's error).

Cases: DeepSeek-V3's latent 512 and rope 64, with 128 query heads (one chip) or 16 (a chip's
share at TP=8), the runner's page sizes (16 tokens, 32 in a float8 cache), decode buckets (one
row a sequence) and mixed/prefill buckets, contexts of 4k to 32k; and the interpret-mode grid's
shapes (tests/pallas_kernels/mla_cases.py) with their odd tunings.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from unittest import mock

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

import pallas_kernels.backend
from tests.aot.compile_kernels import KERNEL_CALL
from tests.aot.kernel_cases import BACKEND
from tests.pallas_kernels.mla_cases import GRID, MlaCase
from tpu_platform.planner.targets import compile_only_devices

TARGETS = {"tpu": ("v5e-1", "v6e-1"), "cuda": ("h100x1",)}
ERROR_CHARS = 1500


@dataclasses.dataclass(frozen=True)
class MlaCompileCase:
    """Static shapes of one layer's latent attention step: T rows over R slots of `context`."""

    name: str
    num_tokens: int
    num_slots: int
    context: int
    page_size: int
    num_heads: int
    latent_dim: int = 512
    rope_dim: int = 64
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    tpu_tuning: tuple[tuple[str, int], ...] = ()
    gpu_tuning: tuple[tuple[str, int], ...] = ()
    extra_pages: int = 0
    expect_error: str = ""  # kernel_checks.check_compiled reads it

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype


FP8 = "float8_e4m3fn"
# fmt: off
REALISTIC = (
    # name, T, R, context, page size, H, ...
    MlaCompileCase("v3_decode_h128_r64_32k", 64, 64, 32768, 16, 128),
    MlaCompileCase("v3_decode_h16_r256_8k", 256, 256, 8192, 16, 16),
    MlaCompileCase("v3_decode_h16_r128_8k_fp8", 128, 128, 8192, 32, 16, kv_dtype=FP8),
    MlaCompileCase("v3_mixed_h128_t512_r64_4k", 512, 64, 4096, 16, 128),
    MlaCompileCase("v3_prefill_h16_t2048_r16_32k_fp8", 2048, 16, 32768, 32, 16, kv_dtype=FP8),
)
# fmt: on


def from_interpret_case(case: MlaCase) -> MlaCompileCase:
    """The shapes (and tunings) of an interpret-mode grid case."""
    return MlaCompileCase(
        name=f"grid_{case.name}",
        num_tokens=sum(case.q_lens) + case.pad_tokens,
        num_slots=case.num_slots,
        context=max(case.kv_lens, default=1),
        page_size=case.page_size,
        num_heads=case.num_heads,
        latent_dim=case.latent_dim,
        rope_dim=case.rope_dim,
        dtype=jnp.dtype(case.dtype).name,
        kv_dtype=jnp.dtype(case.kv_dtype).name if case.kv_dtype else None,
        tpu_tuning=case.tpu_tuning,
        gpu_tuning=case.gpu_tuning,
        extra_pages=5,
    )


CASES = (*(from_interpret_case(c) for c in GRID), *REALISTIC)


def plan(platform: str) -> list[tuple[str, MlaCompileCase]]:
    """Every (target, case) pair compiled for `platform` ("tpu" or "cuda")."""
    return [(t, c) for t in TARGETS[platform] for c in CASES]


# `make test` compiles each TPU case for one of v5e and v6e (the kernel's code is the same on
# both; what differs, VMEM and tiling, shows in each chip's decode and float8 cases): the grid
# on v5e, the realistic DeepSeek-V3 steps on v6e (the chip of its v6e-8 compiles), and on v5e
# its plain and float8 decodes too. The H100 compiles every case. The rest: `make test-full`.
V5E_REALISTIC_IN_MAKE_TEST = frozenset({"v3_decode_h128_r64_32k", "v3_decode_h16_r128_8k_fp8"})


def in_full_only(target: str, case: MlaCompileCase) -> bool:
    """Whether `make test` leaves the pair to `make test-full`."""
    grid = case.name.startswith("grid_")
    if target == "v6e-1":
        return grid
    if target == "v5e-1":
        return not grid and case.name not in V5E_REALISTIC_IN_MAKE_TEST
    return False


def _abstract_args(case: MlaCompileCase, backend: str, sharding) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(cache, q, latent, k_rope, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs)."""

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    width = case.latent_dim + case.rope_dim
    num_pages = case.num_slots * case.pages_per_seq + case.extra_pages
    cache = jax.eval_shape(
        lambda: pallas_kernels.allocate_latent_cache(
            num_pages, case.page_size, width, case.cache_dtype, backend=backend
        )
    )
    t, r = case.num_tokens, case.num_slots
    return (
        sds(cache.shape, cache.dtype),
        sds((t, case.num_heads, width), case.dtype),
        sds((t, case.latent_dim), case.dtype),
        sds((t, case.rope_dim), case.dtype),
        sds((t,), jnp.int32),
        sds((r,), jnp.int32),
        sds((r, case.pages_per_seq), jnp.int32),
        sds((r + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


def layer_step(case: MlaCompileCase, backend: str, platform: str):
    """A layer's latent attention as the model step runs it: write this step's rows, then attend."""
    tuning = dict(case.tpu_tuning if platform == "tpu" else case.gpu_tuning)
    width = case.latent_dim + case.rope_dim

    def step(cache, q, latent, k_rope, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
        common = dict(backend=backend, kv_dtype=case.cache_dtype)
        cache = pallas_kernels.write_latent(cache, latent, k_rope, slot_mapping, **common)
        out = pallas_kernels.mla_paged_attention(
            q, cache, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=width**-0.5, latent_dim=case.latent_dim, **common, **tuning,
        )  # fmt: skip
        return out, cache

    return jax.jit(step, donate_argnums=0)


def compile_case(target: str, platform: str, case: MlaCompileCase) -> dict:
    """Compiles the case's layer step for one device of `target`: its figures, or its error."""
    import time

    device = compile_only_devices(target)[0]
    backend = BACKEND[platform]
    args = _abstract_args(case, backend, SingleDeviceSharding(device))
    cache_bytes = args[0].size * args[0].dtype.itemsize
    start = time.perf_counter()
    try:  # traced under the target's device, as the planner does: kernel defaults follow its kind
        with jax.default_device(device):
            compiled = layer_step(case, backend, platform).trace(*args).lower().compile()
    except Exception as e:  # Mosaic/Triton/XLA refusals arrive as JaxRuntimeError or ValueError
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:ERROR_CHARS], "cache_bytes": cache_bytes}
    memory = compiled.memory_analysis()
    return {
        "ok": True,
        "seconds": round(time.perf_counter() - start, 3),
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "cache_bytes": cache_bytes,
        "kernel_call": KERNEL_CALL[platform] in compiled.as_text(),
    }


def main(platform: str, *pairs: str) -> None:
    by_name = {c.name: c for c in CASES}
    todo = [(t, by_name[c]) for t, c in (p.split("/", 1) for p in pairs)] if pairs else plan(platform)
    results = {}
    # Backend selection asks JAX's default device, a CPU here: the compile target stands in.
    with mock.patch.object(pallas_kernels.backend, "default_platform", return_value=platform):
        for target, case in todo:
            result = compile_case(target, platform, case)
            print(f"{target}/{case.name}: {result.get('seconds', 'error')}", file=sys.stderr, flush=True)
            results[f"{target}/{case.name}"] = result
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
