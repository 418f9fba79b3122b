# SPDX-License-Identifier: Apache-2.0
"""The device check's further parts: the attention kinds beyond plain GQA, and a tuning sweep.

Imported by `benchmarks/device_check.py` (run that), each part a list of JSON rows:

* `check_variants`: the attention options the model families use, each against the float32
  reference with the same options: GPT-OSS (head dim 64, a learned sink per head, a sliding
  window), Gemma (head dim 256, a window and a logit soft cap), Llama 4 (chunked local
  attention), a float8 cache (against the reference over the same float8 cache, since rounding
  the keys is the cache's doing), and DeepSeek's latent attention (128 heads, latent 512, rope 64).
* `sweep_gpu_tuning`: the Pallas GPU kernels' times over their tuning knobs at the check's
  decode and prefill shapes, beside the defaults of `pallas_kernels/gpu/tuned_block_sizes.py`,
  which no GPU has measured before: the figures to replace them with.

Each part stops starting new rows once `deadline` (a `time.perf_counter()` value) has passed.
"""

from __future__ import annotations

import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from device_check import (
    NATIVE_BACKEND,
    _queued,
    attention_case,
    compared_row,
    median_seconds,
    pipelined_seconds,
)

from pallas_kernels import allocate_latent_cache, mla_paged_attention, write_latent

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def _decode(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    kv_lens = tuple(range(32, 96, 8)) if quick else tuple(range(1024, 3072, 32))
    return (1,) * len(kv_lens), kv_lens


def _prefill(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    q_lens = (32, 16) if quick else (512,) * 4
    return q_lens, q_lens


def _variant_cases(quick: bool) -> list[tuple[str, tuple, tuple, dict]]:
    """(name, (q_lens, kv_lens), heads, attention keywords) of each variant."""
    rng = np.random.default_rng(3)
    decode, prefill = _decode(quick), _prefill(quick)
    gpt_oss_heads = (8, 2) if quick else (64, 8)
    sinks = jnp.asarray(rng.standard_normal(gpt_oss_heads[0]), jnp.float32)
    gemma = {"head_dim": 256, "sliding_window": 24 if quick else 1024, "soft_cap": 50.0}
    windowed = {"head_dim": 64, "sinks": sinks, "sliding_window": 16 if quick else 128}
    chunk = {"attention_chunk_size": 16 if quick else 256}
    return [
        ("gpt_oss_sinks_decode", decode, gpt_oss_heads, {"head_dim": 64, "sinks": sinks}),
        ("gpt_oss_window_decode", decode, gpt_oss_heads, windowed),
        ("gpt_oss_window_prefill", prefill, gpt_oss_heads, windowed),
        ("gemma_256_decode", decode, (4, 2) if quick else (16, 8), gemma),
        ("gemma_256_prefill", prefill, (4, 2) if quick else (16, 8), gemma),
        ("llama4_chunked_prefill", prefill, (4, 2) if quick else (40, 8), chunk),
        ("fp8_cache_decode", decode, (4, 2) if quick else (32, 8), {"kv_dtype": "float8_e4m3fn"}),
        ("fp8_cache_prefill", prefill, (4, 2) if quick else (32, 8), {"kv_dtype": "float8_e4m3fn"}),
    ]  # fmt: skip


def _rows_against(name: str, reference_case, cases: dict, iters: int, **fields) -> list[dict]:
    """A row for each of `cases` ({backend: case}) against `reference_case()`'s output, or one
    row with the reference's error."""
    try:
        reference, _ = reference_case()
    except Exception as error:
        return [
            {"case": name, "backend": "xla", "ok": False, "error": f"{type(error).__name__}: {error}"[:1500]}
        ]
    return [compared_row(name, backend, reference, case, iters, **fields) for backend, case in cases.items()]


def check_variants(platform: str, quick: bool, iters: int, deadline: float) -> list[dict]:
    backends = [NATIVE_BACKEND[platform], "xla"] if platform in NATIVE_BACKEND else ["xla"]
    rows = []
    for name, (q_lens, kv_lens), heads, options in _variant_cases(quick):
        if time.perf_counter() > deadline:
            break
        # A float8 cache is compared with the reference over the same float8 cache.
        reference_dtype = BF16 if "kv_dtype" in options else F32
        reference = functools.partial(
            attention_case, "xla", reference_dtype, q_lens, kv_lens, heads, **options
        )
        cases = {
            b: functools.partial(attention_case, b, BF16, q_lens, kv_lens, heads, **options) for b in backends
        }
        rows += _rows_against(name, reference, cases, iters, tokens=sum(q_lens), kv_tokens=sum(kv_lens))
    return rows + check_latent(backends[0], quick, iters, deadline)


# -- latent attention (DeepSeek's MLA) -----------------------------------------------------------


def latent_case(backend, dtype, q_lens, kv_lens, heads, latent=512, rope=64, page_size=16, **tuning):
    """`backend`'s latent attention output (float32) for the case, and a function that reruns it."""
    rng = np.random.default_rng(5)
    pages_per_seq = -(-max(kv_lens) // page_size)
    table = (
        rng.permutation(len(kv_lens) * pages_per_seq).reshape(len(kv_lens), pages_per_seq).astype(np.int32)
    )
    slots = np.concatenate(
        [table[i, p // page_size] * page_size + p % page_size for i, p in enumerate(map(np.arange, kv_lens))]
    )
    rows_kv = rng.standard_normal((len(slots), latent + rope), np.float32)
    q = rng.standard_normal((sum(q_lens), heads, latent + rope), np.float32)
    cache = allocate_latent_cache(table.size, page_size, latent + rope, dtype, backend=backend)
    write = jax.jit(functools.partial(write_latent, backend=backend, kv_dtype=dtype.name), donate_argnums=0)
    cache = write(
        cache,
        jnp.asarray(rows_kv[:, :latent], dtype),
        jnp.asarray(rows_kv[:, latent:], dtype),
        jnp.asarray(slots, jnp.int32),
    )
    tuning |= {
        "sm_scale": (128 + rope) ** -0.5,
        "latent_dim": latent,
        "backend": backend,
        "kv_dtype": dtype.name,
    }
    attend = jax.jit(functools.partial(mla_paged_attention, **tuning))
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (jnp.asarray(q, dtype), cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table))
    args += (jnp.asarray(cu_q_lens), jnp.asarray([len(kv_lens)], jnp.int32))
    out = np.asarray(attend(*args), np.float32)
    return out, _queued(lambda: attend(*args))


def check_latent(backend: str, quick: bool, iters: int, deadline: float) -> list[dict]:
    heads = 4 if quick else 128
    sizes = {"latent": 32, "rope": 16} if quick else {}
    rows = []
    for name, (q_lens, kv_lens) in {"mla_decode": _decode(quick), "mla_prefill": _prefill(quick)}.items():
        if time.perf_counter() > deadline:
            break
        reference = functools.partial(latent_case, "xla", F32, q_lens, kv_lens, heads, **sizes)
        cases = {
            each: functools.partial(latent_case, each, BF16, q_lens, kv_lens, heads, **sizes)
            for each in dict.fromkeys([backend, "xla"])
        }
        rows += _rows_against(name, reference, cases, iters, tokens=sum(q_lens), kv_tokens=sum(kv_lens))
    return rows


# -- the GPU kernels' tuning ---------------------------------------------------------------------


def _sweep_grid(kind: str) -> list[dict]:
    if kind == "decode":
        axes = {"num_kv_pages_per_block": (1, 2, 4, 8), "num_kv_splits": (4, 8, 16), "num_warps": (4, 8)}
    elif kind == "prefill":
        axes = {
            "num_kv_pages_per_block": (2, 4, 8),
            "num_queries_per_block": (8, 16, 32),
            "num_warps": (4, 8),
        }
    else:  # latent decode
        axes = {"num_kv_pages_per_block": (1, 2, 4), "num_kv_splits": (4, 8, 16)}
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def sweep_gpu_tuning(
    quick: bool, iters: int, deadline: float, heads: tuple[int, int] = (32, 8)
) -> list[dict]:
    """Median seconds of each tuning of the GPU kernels (a failed one keeps its error)."""
    cases = {
        "decode": functools.partial(attention_case, "pallas_gpu", BF16, *_decode(quick), heads),
        "prefill": functools.partial(attention_case, "pallas_gpu", BF16, *_prefill(quick), heads),
        "mla_decode": functools.partial(
            latent_case, "pallas_gpu", BF16, *_decode(quick), 4 if quick else 128
        ),
    }
    rows = []
    for kind, case in cases.items():
        default, rerun = case()
        median_seconds(rerun, iters)
        rows.append(
            {"case": kind, "tuning": "default", "pipelined_seconds": pipelined_seconds(rerun, 2 * iters)}
        )
        for tuning in _sweep_grid(kind):
            if time.perf_counter() > deadline:
                return rows
            row = {"case": kind, "tuning": tuning}
            try:
                out, rerun = case(**tuning)
                row["max_abs_diff_from_default"] = float(np.max(np.abs(out - default)))
                row["median_seconds"] = median_seconds(rerun, iters)
                row["pipelined_seconds"] = pipelined_seconds(rerun, 2 * iters)
                ms, queued = row["median_seconds"] * 1e3, row["pipelined_seconds"] * 1e3
                print(f"sweep {kind:10s} {tuning} {ms:.3f} ms ({queued:.3f} queued)")
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"[:600]
            rows.append(row)
    return rows
