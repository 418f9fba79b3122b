# SPDX-License-Identifier: Apache-2.0
"""Checks and times the kernels and the step program on whatever accelerator JAX sees. JAX only.

Runs where only JAX (0.10 or 0.11) and Flax are installed, with this repository on PYTHONPATH:
no vLLM, no torch. Two parts, one JSON document out:

1. Attention: each backend that runs natively here (`pallas_tpu` on TPU, `pallas_gpu` on GPU, and
   the `xla` reference everywhere) on a decode batch (64 sequences over 1-3k tokens) and a
   prefill batch (8 chunks of 512 tokens), Llama-3.1-8B's heads, bfloat16, against the reference
   computed in float32: the largest absolute error, and the median time.
2. The step program: the runner's one-chip forward (`tpu_platform.planner.plan.step_program`, the one
   builder the runner uses) of a Llama-3.1-8B-shaped model with random weights, for decode
   batches of 1, 16 and 64 sequences at `--context` tokens each and one 512-token prefill, timed
   warm (median of `--iters`), beside the planner's figures for the chip: the decode roofline
   (`planner.kv.decode_roofline`: weights and KV read once at peak bandwidth) and XLA's cost model
   of the compiled program (`planner.kv.xla_decode_estimate`).

    PYTHONPATH=. python benchmarks/device_check.py [--out device_check.json] [--iters 10]
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/device_check.py --quick   # a CPU smoke run

`--quick` shrinks every shape (a 2-layer model of small widths, short contexts) so the whole path
runs on a CPU in about a minute; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from models import ModelConfig
from pallas_kernels import api
from tpu_platform.inputs import StepInputs, pack_inputs
from tpu_platform.planner.compiled import program_facts
from tpu_platform.planner.kv import decode_roofline, xla_decode_estimate
from tpu_platform.planner.plan import StepSetup, model_config, step_program, step_shape

# The planner's target whose chip facts (memory, bandwidth) describe a device kind.
TARGET_FOR_KIND = {
    "TPU v4": "v4-8", "TPU v5 lite": "v5e-1", "TPU v5e": "v5e-1", "TPU v5p": "v5p-8", "TPU v5": "v5p-8",
    "TPU v6 lite": "v6e-1", "TPU v6e": "v6e-1", "NVIDIA H100": "h100x1",
    "NVIDIA H200": "h200x1", "NVIDIA A100": "a100x1", "NVIDIA L4": "l4x1",
}  # fmt: skip
# Without known facts, a target of the same platform gives the runner's page size and backend.
FALLBACK_TARGET = {"tpu": "v6e-1", "gpu": "h100x1", "cpu": "v6e-1"}
NATIVE_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}
QUICK_MODEL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Sizes:
    decode_batches: tuple[int, ...]
    context: int
    prefill_tokens: int
    attention_decode: tuple[int, ...]  # kv lengths of the attention check's decode batch
    attention_prefill: tuple[int, ...]  # q lengths of its prefill batch (kv = q)
    heads: tuple[int, int]  # q and kv heads of the attention check


FULL = Sizes((1, 16, 64), 1024, 512, tuple(range(1024, 3072, 32)), (512,) * 8, (32, 8))
QUICK = Sizes((1, 4), 64, 32, tuple(range(32, 96, 8)), (32, 16), (4, 2))


def median_seconds(fn, iters: int) -> float:
    """The median of `iters` timed calls of `fn()`, each waited for (after one to compile)."""
    fn()  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipelined_seconds(fn, iters: int, repeats: int = 3) -> float:
    """Seconds per call of `fn(n)` (n calls queued, the last waited for): the device's time per
    call without the host's wait for each, the best of `repeats` (`fn` compiled already)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(iters)
        times.append((time.perf_counter() - start) / iters)
    return min(times)


def _queued(call):
    """`n` calls of `call()` queued one after another, the last one waited for."""

    def run(n: int = 1):
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)

    return run


# -- 1. attention -------------------------------------------------------------------------------


def _paged(q_lens, kv_lens, heads, page_size, seed=0, head_dim=128):
    """Random q, k, v and a shuffled block table for sequences of `kv_lens` cached tokens whose
    last `q_lens` are this step's queries."""
    rng = np.random.default_rng(seed)
    num_q, num_kv = heads
    pages_per_seq = -(-max(kv_lens) // page_size)
    table = rng.permutation(len(kv_lens) * pages_per_seq).reshape(len(kv_lens), pages_per_seq)
    slots = np.concatenate(
        [table[i, p // page_size] * page_size + p % page_size for i, p in enumerate(map(np.arange, kv_lens))]
    )
    k, v = (rng.standard_normal((len(slots), num_kv, head_dim), np.float32) for _ in range(2))
    q = rng.standard_normal((sum(q_lens), num_q, head_dim), np.float32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, k, v, slots.astype(np.int32), table.astype(np.int32), cu_q_lens


def attention_case(
    backend, dtype, q_lens, kv_lens, heads, page_size=16, *, kv_dtype=None, head_dim=128, **options
):
    """`backend`'s attention output (float32) for the case, and a function that reruns it.
    `kv_dtype`: the cache's values when not `dtype` (float8); `options`: the attention's own
    keywords (sinks, sliding_window, soft_cap, attention_chunk_size) and a Pallas kernel's tuning."""
    q, k, v, slots, table, cu_q_lens = _paged(q_lens, kv_lens, heads, page_size, head_dim=head_dim)
    cache_dtype = jnp.dtype(kv_dtype or dtype)
    cache = api.allocate_kv_cache(table.size, page_size, heads[1], head_dim, cache_dtype, backend=backend)
    write = jax.jit(
        functools.partial(api.write_kv, backend=backend, kv_dtype=cache_dtype.name), donate_argnums=0
    )
    cache = write(cache, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(slots))
    options |= {"sm_scale": head_dim**-0.5, "backend": backend, "kv_dtype": cache_dtype.name}
    attend = jax.jit(functools.partial(api.ragged_paged_attention, **options))
    args = (jnp.asarray(q, dtype), cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table))
    args += (jnp.asarray(cu_q_lens), jnp.asarray([len(kv_lens)], jnp.int32))
    out = np.asarray(attend(*args), np.float32)
    return out, _queued(lambda: attend(*args))


def compared_row(name, backend, reference, case, iters, **fields) -> dict:
    """One backend's row against `reference` (float32 output): its largest error and median time,
    or the error it raised (a failing case must not end the run: the chip's time is scarce)."""
    row = {"case": name, "backend": backend, **fields}
    try:
        out, rerun = case()
        row["max_abs_error"] = float(np.max(np.abs(out - reference)))
        row["ok"] = row["max_abs_error"] < 5e-2
        row["median_seconds"] = median_seconds(rerun, iters)
        row["pipelined_seconds"] = pipelined_seconds(rerun, iters)
        ms, queued = row["median_seconds"] * 1e3, row["pipelined_seconds"] * 1e3
        error = row["max_abs_error"]
        print(f"attention {name:16s} {backend:10s} max |err| {error:.2e}  {ms:.3f} ms ({queued:.3f} queued)")
    except Exception as error:
        row.update(ok=False, error=f"{type(error).__name__}: {error}"[:1500])
        print(f"attention {name:16s} {backend:10s} FAILED {row['error'][:300]}")
    return row


def check_attention(platform: str, sizes: Sizes, iters: int) -> list[dict]:
    backends = [NATIVE_BACKEND[platform], "xla"] if platform in NATIVE_BACKEND else ["xla"]
    cases = {
        "decode": ((1,) * len(sizes.attention_decode), sizes.attention_decode),
        "prefill": (sizes.attention_prefill, sizes.attention_prefill),
    }
    rows = []
    for name, (q_lens, kv_lens) in cases.items():
        reference, _ = attention_case("xla", jnp.dtype(jnp.float32), q_lens, kv_lens, sizes.heads)
        for backend in backends:
            case = functools.partial(
                attention_case, backend, jnp.dtype(jnp.bfloat16), q_lens, kv_lens, sizes.heads
            )
            rows.append(
                compared_row(
                    name, backend, reference, case, iters, tokens=sum(q_lens), kv_tokens=sum(kv_lens)
                )
            )
    return rows


# -- 2. the step program ------------------------------------------------------------------------


def decode_inputs(shape, batch: int, context: int, page_size: int, pages_per_seq: int) -> StepInputs:
    """`batch` sequences of `context` tokens, each decoding its last one from pages of its own."""
    t_pad, r_pad, p_pad = shape
    table = np.zeros((1, r_pad, p_pad), np.int32)
    table[0, :batch, :pages_per_seq] = np.arange(batch * pages_per_seq).reshape(batch, pages_per_seq)
    last = context - 1
    slots = np.full((1, t_pad), -1, np.int32)
    slots[0, :batch] = table[0, :batch, last // page_size] * page_size + last % page_size
    return _inputs(t_pad, r_pad, table, slots, np.full(batch, context), np.full(batch, last), batch)


def prefill_inputs(shape, tokens: int, page_size: int) -> StepInputs:
    """One sequence's first `tokens` tokens in one chunk."""
    t_pad, r_pad, p_pad = shape
    table = np.zeros((1, r_pad, p_pad), np.int32)
    table[0, 0] = np.arange(p_pad)
    slots = np.full((1, t_pad), -1, np.int32)
    slots[0, :tokens] = np.arange(tokens)
    return _inputs(t_pad, r_pad, table, slots, np.array([tokens]), np.arange(tokens), 1, q_len=tokens)


def _inputs(t_pad, r_pad, table, slots, kv_lens, positions, num_seqs, q_len=1) -> StepInputs:
    rng = np.random.default_rng(0)
    cu_q_lens = np.full(r_pad + 1, num_seqs * q_len, np.int32)
    cu_q_lens[: num_seqs + 1] = np.arange(num_seqs + 1) * q_len
    padded = lambda values, size: np.pad(np.asarray(values, np.int32), (0, size - len(values)))  # noqa: E731
    return StepInputs(
        token_ids=rng.integers(0, 500, t_pad, dtype=np.int32), positions=padded(positions, t_pad),
        slot_mapping=slots, kv_lens=padded(kv_lens, r_pad), page_indices=table, cu_q_lens=cu_q_lens,
        num_seqs=np.array([num_seqs], np.int32),
        logits_indices=padded(cu_q_lens[1 : num_seqs + 1] - 1, r_pad),
        feed=np.full(t_pad, -1, np.int32), lora_slots=np.zeros(t_pad, np.int32),
    )  # fmt: skip


def random_like(abstract, device, seed: int):
    """Arrays of `abstract`'s shapes and dtypes on `device`: small normal values (integers zero)."""
    keys = jax.random.split(jax.random.key(seed), len(abstract))

    def make(key, leaf):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return jnp.zeros(leaf.shape, leaf.dtype)
        return (0.02 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype)

    with jax.default_device(device):
        return [jax.jit(make, static_argnums=1)(key, leaf) for key, leaf in zip(keys, abstract, strict=True)]


def check_step(device, quick: bool, sizes: Sizes, iters: int) -> dict:
    target = next((t for kind, t in TARGET_FOR_KIND.items() if device.device_kind.startswith(kind)), None)
    if quick:  # the planner's figures of a chip, for the code path: here they mean nothing
        target = target or FALLBACK_TARGET[device.platform]
    config = QUICK_MODEL if quick else model_config("llama-3.1-8b")
    max_batch = max(sizes.decode_batches)
    setup = StepSetup(
        config, target or FALLBACK_TARGET[device.platform], max_num_seqs=max_batch,
        max_model_len=max(sizes.context, sizes.prefill_tokens), max_num_batched_tokens=sizes.prefill_tokens,
        attention_backend=NATIVE_BACKEND.get(device.platform, "xla"),
    )  # fmt: skip
    page_size = setup.tokens_per_page
    pages_per_seq = -(-sizes.context // page_size)
    num_pages = max(max_batch * pages_per_seq, -(-sizes.prefill_tokens // page_size))
    program = step_program(setup, num_pages, device=device)
    state = random_like(program.state, device, seed=1)
    caches = [jnp.zeros(c.shape, c.dtype, device=device) for c in program.caches]
    fed = jax.device_put(np.zeros(program.feed_width, np.int32), device)
    steps = {f"decode_{b}": (b, decode_inputs) for b in sizes.decode_batches}
    steps[f"prefill_{sizes.prefill_tokens}"] = (sizes.prefill_tokens, None)
    rows = {}
    for name, (count, _) in steps.items():
        prefill = name.startswith("prefill")
        shape = step_shape(setup, count, 1 if prefill else count)
        if prefill:
            inputs = prefill_inputs(shape, count, page_size)
        else:
            inputs = decode_inputs(shape, count, sizes.context, page_size, pages_per_seq)
        packed, _ = pack_inputs(inputs)
        start = time.perf_counter()
        compiled = program.compile(shape)
        facts = program_facts(compiled, time.perf_counter() - start)
        holder = {"caches": caches}

        def run(n=1, compiled=compiled, packed=packed, holder=holder):
            for _ in range(n):
                out = compiled(state, holder["caches"], packed, fed)
                holder["caches"] = out[3]
            jax.block_until_ready(out[1])

        seconds = median_seconds(run, iters)
        queued = pipelined_seconds(run, iters)
        caches = holder["caches"]
        row = {"shape": list(shape), "median_seconds": seconds, "tokens_per_second": count / seconds}
        row["pipelined_seconds"] = queued  # steps queued back to back, as the runner's async steps run
        row["program"] = {
            k: facts.as_dict()[k] for k in ("peak_bytes", "temp_bytes", "flops", "bytes_accessed")
        }
        if target is not None and not prefill:
            row["roofline"] = decode_roofline(setup, count, sizes.context)
            row["xla_cost_model"] = xla_decode_estimate(setup, facts, count)
        rows[name] = row
        rate = count / seconds
        print(f"step {name:12s} {seconds * 1e3:9.3f} ms ({queued * 1e3:.3f} queued)  {rate:10.1f} tokens/s")
    return {"model": config.architecture, "layers": config.num_layers, "target_facts": target,
            "backend": setup.backend, "context": sizes.context, "steps": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device_check.json")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--context", type=int, help="tokens each decode sequence holds (default 1024)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke run")
    parser.add_argument(
        "--budget", type=float, default=420, help="seconds after which no further part starts"
    )
    parser.add_argument(
        "--parts",
        default="attention,step,variants,sweep",
        help="which parts to run, comma-separated, in order",
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.context:
        sizes = dataclasses.replace(sizes, context=args.context)
    iters = 2 if args.quick else args.iters
    device = jax.devices()[0]
    print(f"device: {device.platform} / {device.device_kind}, JAX {jax.__version__}")
    from device_variants import check_variants, sweep_gpu_tuning  # it imports this module's helpers

    start = time.perf_counter()
    deadline = start + args.budget
    report = {
        "device": {"platform": device.platform, "kind": device.device_kind, "jax": jax.__version__},
        "quick": args.quick,
    }
    parts = {
        "attention": lambda: check_attention(device.platform, sizes, iters),
        "step": lambda: check_step(device, args.quick, sizes, iters),
        "variants": lambda: check_variants(device.platform, args.quick, iters, deadline),
        "sweep": lambda: sweep_gpu_tuning(args.quick, iters, deadline) if device.platform == "gpu" else [],
    }
    for name in args.parts.split(","):
        try:
            report[name] = parts[name]()
        except Exception as error:  # e.g. the weights and cache exceed the chip: keep the rest
            report[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            print(f"{name}: {report[name]['error']}")
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2))
    report["seconds"] = time.perf_counter() - start
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    checked = [row for part in ("attention", "variants") for row in report.get(part, [])]
    if any("error" in report[name] for name in report if isinstance(report[name], dict)):
        sys.exit("a part of the check did not run: see " + args.out)
    if not all(row["ok"] for row in checked):
        sys.exit("an attention backend disagrees with the reference: see " + args.out)


if __name__ == "__main__":
    main()
