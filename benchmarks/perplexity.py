# SPDX-License-Identifier: Apache-2.0
"""Perplexity of the served path: the embedded SmolLM2-135M-Instruct (a GGUF whose projections
are Q4_1) served from its 4-bit blocks as it ships, against its dequantized float weights in
bfloat16, those float weights quantized at load to int8 and to fp8, and converted to int4
(`vllm-xla convert --quantization int4`: compressed-tensors W4A16 in groups of 128, where the
model's 576-wide inputs do not split, so only down_proj is grouped and the other projections
are quantized per channel at load; and in groups of 64, which split every projection).

    .venv/bin/python benchmarks/perplexity.py [--out benchmarks/results/perplexity.json]
        [--tokens 320] [--configs NAME ...]

The float weights are the Q4_1 model's dequantized ones: re-grouping weights that were 4-bit
already costs more than quantizing a model trained in float would.

The text is the tests' fixed public-domain one (tests/data/alice.txt), its first `--tokens`
tokens. Each configuration runs in its own subprocess (this script with `--worker`): vLLM's
`LLM` in-process, one request of the text with `prompt_logprobs=0`, so every token's log
probability comes through the served step (the engine's own prefill, logits and log-softmax).
Perplexity is `exp(-mean log p(token | tokens before))` over every token but the first.
Reported: each configuration's perplexity, its ratio to the dequantized bfloat16 model's and that
ratio's 95% interval (`paired_bootstrap.ratio_interval`: a paired bootstrap over blocks of 16
tokens of the two configurations' per-token negative log-likelihoods; the text is short, so a
ratio whose interval holds 1.01 is not told apart from +1%).

`--chunk 16` prefills in chunks of 16 rows, so the int4 kernel's few-row path ("avx512_vnni")
computes every projection; `q4_1_x16` and `q4_1_x8` force its x to two byte planes a row or one
8-bit plane a 32-block (`native_dense_int4(x_bits=...)`), each with an executable cache of its own.
They run only with `--chunk 16` or less: a larger chunk's products take the many-row path, where
x_bits does not apply (named, they are refused; by default, left out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from paired_bootstrap import ratio_interval  # noqa: E402

TEXT = HERE.parent / "tests" / "data" / "alice.txt"
# name -> (which model directory, vLLM's `quantization`)
CONFIGS = {
    "q4_1_as_shipped": ("gguf", None),
    # the int4 kernel's few-row path with x forced to two byte planes a row or one a 32-block
    # (`native_dense_int4(x_bits=...)`); only prefill chunks of at most 16 rows (`--chunk 16`) take it
    "q4_1_x16": ("gguf", None),
    "q4_1_x8": ("gguf", None),
    "bfloat16_dequantized": ("float", None),
    "int8_online": ("float", "int8_per_channel_weight_only"),
    "fp8_online": ("float", "fp8"),
    "int4_converted_g64": ("int4_g64", None),
}
REFERENCE = "bfloat16_dequantized"
BOOTSTRAP_BLOCK = 16  # tokens a resampled block holds: neighbouring tokens' losses are correlated
X_BITS = {"q4_1_x16": 16, "q4_1_x8": 8}  # configurations that force `native_dense_int4(x_bits=...)`
# The int4 kernel's "avx512_vnni" path, the one `x_bits` picks a width on, takes products of at most
# this many rows; a larger chunk runs "avx512_bf16", where x_bits does not apply, so a forced
# x_bits configuration run there is the as-shipped one under another name. (The kernel's own
# `kVnniRowsAtMost`, dense_int4_avx2.h; tests/test_benchmark_perplexity.py checks the two agree.)
X_BITS_ROWS_AT_MOST = 16


def chosen_configs(requested: list[str] | None, chunk: int) -> set[str]:
    """The configurations to run: `requested` (all when None, less those that `chunk` cannot
    measure) and `REFERENCE`. A forced-x_bits configuration named with a chunk past the few-row
    path is refused, naming the chunk that measures it."""
    if requested is None:
        requested = [name for name in CONFIGS if name not in X_BITS or chunk <= X_BITS_ROWS_AT_MOST]
    unreachable = sorted(name for name in requested if name in X_BITS and chunk > X_BITS_ROWS_AT_MOST)
    if unreachable:
        raise ValueError(
            f"{', '.join(unreachable)}: x_bits is forced on the int4 kernel's few-row path (at most "
            f"{X_BITS_ROWS_AT_MOST} rows), which --chunk {chunk} never takes: run with "
            f"--chunk {X_BITS_ROWS_AT_MOST}"
        )
    return {REFERENCE, *requested}


def float_copy(gguf_dir: str, out: str) -> str:
    """`gguf_dir` (the embedded model's directory) with its GGUF dequantized to float32 safetensors."""
    from safetensors.numpy import save_file

    from models.gguf_reader import iter_hf_tensors

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(gguf_dir):
        if not name.endswith(".gguf") and not name.startswith("."):
            shutil.copy(os.path.join(gguf_dir, name), out)
    gguf = next(n for n in os.listdir(gguf_dir) if n.endswith(".gguf"))
    save_file(dict(iter_hf_tensors(os.path.join(gguf_dir, gguf))), os.path.join(out, "model.safetensors"))
    return out


def _force_x_bits(x_bits: int) -> None:
    """Every int4 product of this process with x in `x_bits` (the models call through the module)."""
    import functools

    from pallas_kernels import cpu

    cpu.native_dense_int4 = functools.partial(cpu.native_dense_int4, x_bits=x_bits)


def _own_executables(name: str, cache_dir: str, scratch: str) -> dict:
    """The environment of a configuration that forces `x_bits`: a cache directory of its own
    (sharing the native kernels and the model) so that no executable serialized for another
    configuration (keyed by the code, not by the forced argument) serves it."""
    if name not in X_BITS:
        return {}
    own = os.path.join(scratch, f"cache-{name}")
    os.makedirs(own, exist_ok=True)
    for shared in ("native", "models"):
        os.symlink(os.path.join(cache_dir, shared), os.path.join(own, shared))
    return {"VLLM_XLA_CACHE_DIR": own}


def worker(model: str, quantization: str | None, tokens: int, chunk: int, x_bits: int | None) -> dict:
    from plugin_shim.devices import detect_device_kind

    if x_bits:
        _force_x_bits(x_bits)
    os.environ.setdefault("VLLM_XLA_PLATFORM", detect_device_kind())  # the plugin, on JAX's device
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_XLA_CPU_KV_CACHE_GB", "0.25")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = AutoTokenizer.from_pretrained(model)(TEXT.read_text())["input_ids"][:tokens]
    llm = LLM(
        model=model, quantization=quantization, dtype="bfloat16", max_model_len=512, max_num_seqs=1,
        max_num_batched_tokens=chunk, seed=0,
    )  # fmt: skip
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    logprobs = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    nll = [-logprob for logprob in logprobs]
    return {"tokens": len(ids), "perplexity": math.exp(sum(nll) / len(nll)), "nll": nll}


def _add_ratios(results: dict) -> None:
    """Each measured configuration's ratio to `REFERENCE` and its 95% interval (paired block
    bootstrap over the same tokens' losses); the per-token losses are then dropped."""
    reference = results[REFERENCE].get("nll")
    for entry in results.values():
        nll = entry.pop("nll", None)
        if reference and nll is not None:
            entry["ratio_to_bfloat16"] = entry["perplexity"] / results[REFERENCE]["perplexity"]
            interval = ratio_interval(nll, reference, block=BOOTSTRAP_BLOCK)
            entry["ratio_interval_95"] = [round(bound, 4) for bound in interval]


def _machine() -> dict:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return {"cpu_model": model, "nproc": os.cpu_count(), "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(HERE / "results" / "perplexity.json"))
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument(
        "--chunk",
        type=int,
        default=512,
        help="prefill chunk (max_num_batched_tokens): 16 runs the few-row paths",
    )
    parser.add_argument(
        "--configs", nargs="+", choices=sorted(CONFIGS),
        help=f"the configurations to run (default: all that --chunk measures; {REFERENCE} always "
        "runs: the ratios' reference)",
    )  # fmt: skip
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "QUANTIZATION"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model, quantization = args.worker
        x_bits = X_BITS.get(args.worker_name)
        result = worker(
            model, None if quantization == "none" else quantization, args.tokens, args.chunk, x_bits
        )
        print("RESULT " + json.dumps(result), flush=True)
        return

    try:
        chosen = chosen_configs(args.configs, args.chunk)
    except ValueError as error:
        parser.error(str(error))
    from plugin_shim.model_dir import materialize
    from tpu_platform.envs import read_env
    from tpu_platform.weights.int4_convert import convert_int4

    gguf_dir = materialize(read_env().cache_dir)
    scratch = tempfile.mkdtemp(prefix="perplexity-")
    try:
        dirs = {"gguf": gguf_dir, "float": float_copy(gguf_dir, os.path.join(scratch, "float"))}
        for group in (64,):  # the model's 576-wide inputs split into 64s, not 128s
            dirs[f"int4_g{group}"] = os.path.join(scratch, f"int4_g{group}")
            if f"int4_converted_g{group}" in chosen:
                convert_int4(dirs["float"], dirs[f"int4_g{group}"], group)
        results = {}
        for name, (which, quantization) in CONFIGS.items():
            if name not in chosen:
                continue
            command = [sys.executable, __file__, "--tokens", str(args.tokens), "--chunk", str(args.chunk)]
            command += ["--worker-name", name, "--worker", dirs[which]]
            env = os.environ | _own_executables(name, read_env().cache_dir, scratch)
            done = subprocess.run([*command, quantization or "none"], capture_output=True, text=True, env=env)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                results[name] = {"status": "failed", "error": done.stderr[-2000:]}
            else:
                results[name] = {"status": "ok", "quantization": quantization} | json.loads(lines[-1][7:])
            print(name, json.dumps(results[name])[:300], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _add_ratios(results)
    report = {
        "benchmark": "perplexity",
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "text": "tests/data/alice.txt",
        "dtype": "bfloat16",
        "prefill_chunk": args.chunk,
        "machine": _machine(),
        "results": results,
    }
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
