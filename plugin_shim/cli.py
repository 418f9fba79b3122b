# SPDX-License-Identifier: Apache-2.0
"""The `vllm-xla` command: `model-dir`, `generate`, `serve` and `convert`."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading

from tpu_platform.attention_backend import native_build_dir
from tpu_platform.envs import XlaEnv, read_env
from tpu_platform.kv_cache import model_kv_bytes_per_token, pages_for_sequences
from tpu_platform.metrics_file import metrics_path, remove_metrics
from tpu_platform.runner_config import default_page_size


def _ensure_platform() -> None:
    """Activates the plugin for the device kind JAX would use here, unless already chosen."""
    if not os.environ.get("VLLM_XLA_PLATFORM"):
        from plugin_shim.devices import detect_device_kind

        os.environ["VLLM_XLA_PLATFORM"] = detect_device_kind()


def _builds_native_kernels(env: XlaEnv) -> bool:
    return env.platform == "cpu" and env.attention_backend in ("auto", "cpu_native")


def _build_native_kernels_quietly(build_dir: str) -> None:
    from pallas_kernels.cpu.build import NativeKernelError, build_library

    try:
        build_library(build_dir)
    except NativeKernelError:
        pass  # the worker reports it, and falls back or fails as configured


def _start_native_build(env: XlaEnv) -> threading.Thread | None:
    """Starts building the native CPU kernels while vLLM imports (on the otherwise idle core: the
    build is a noticeable part of a cold start); the worker then finds the library, or waits for
    this build to finish."""
    if not _builds_native_kernels(env):
        return None
    import pallas_kernels.cpu.build  # noqa: F401  (imported here, not in the thread: no import races)

    thread = threading.Thread(
        target=_build_native_kernels_quietly, args=(native_build_dir(env.cache_dir),), daemon=True
    )
    thread.start()
    return thread


def _auto_dtype(requested: str, env: XlaEnv, build: threading.Thread | None) -> str:
    """`generate`'s and `serve`'s `auto`: bfloat16 where the native dense kernel runs (AMX, AVX-512
    BF16 or AVX2: faster to run and to compile; vLLM's own `auto` keeps a float32 checkpoint, the
    embedded model's among them, in float32 on CPU), else vLLM's own choice."""
    if requested != "auto" or build is None:
        return requested
    from tpu_platform.attention_backend import native_dense_isa, select_backend

    build.join()
    backend = select_backend(env.attention_backend, "cpu", env.cache_dir)
    return "bfloat16" if native_dense_isa(backend, env.cache_dir) else requested


def _default_model() -> str:
    from plugin_shim.model_dir import materialize

    return materialize(read_env().cache_dir)


def cmd_model_dir(args: argparse.Namespace) -> int:
    from plugin_shim.model_dir import materialize

    print(materialize(read_env().cache_dir, args.gguf))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    _ensure_platform()
    env = read_env()
    build = _start_native_build(env)
    # A one-shot offline run: the engine runs in this process, with no second interpreter to
    # start (importing vLLM, torch and JAX again) and to shut down.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from plugin_shim.active import assert_active

    max_num_seqs = args.max_num_seqs or min(len(args.prompts), 16)
    model = args.model or _default_model()
    dtype = _auto_dtype(args.dtype, env, build)
    llm = LLM(
        model=model,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or step_token_budget(args.prompts, max_num_seqs),
        num_gpu_blocks_override=one_shot_kv_pages(model, dtype, max_num_seqs, args.max_model_len, env),
        load_format="npcache",  # keeps the prepared weights: a later start restores them
        dtype=dtype,
        seed=args.seed,
    )
    assert_active()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for prompt, output in zip(args.prompts, llm.generate(args.prompts, params), strict=True):
        print(f"{prompt}{output.outputs[0].text}")
    # What the engine's shutdown would do that outlives the process: the worker's metrics file.
    # The shutdown itself (vLLM's full garbage collection, the caches freed) is skipped.
    config = llm.llm_engine.vllm_config
    remove_metrics(metrics_path(env.cache_dir, config.instance_id, config.parallel_config.data_parallel_rank))
    if build is not None:
        build.join()
    return 0


def one_shot_kv_pages(
    model: str, dtype: str, max_num_seqs: int, max_model_len: int, env: XlaEnv
) -> int | None:
    """`generate`'s KV cache on the CPU device, in pages (vLLM's `num_gpu_blocks_override`): what
    its sequences can fill at once, within the `VLLM_XLA_CPU_KV_CACHE_GB` budget, so that a
    one-shot run does not allocate and zero the whole budget. None (the budget)
    on other devices, for a model that is not a directory we can read, and for one whose layers
    attend differently (sliding windows beside full attention): vLLM then keeps a group of pages
    per kind of layer, and a request's pages add up over the groups."""
    if env.platform != "cpu" or not os.path.isdir(model):
        return None
    from models.config import ModelConfig

    try:
        config = ModelConfig.from_pretrained(model)
    except (OSError, KeyError, ValueError):
        return None  # vLLM reports what is wrong with the model
    if len(set(config.layer_sliding_windows)) > 1:
        return None
    page_size = default_page_size("cpu", None)
    itemsize = 2 if dtype in ("bfloat16", "float16", "half") else 4  # "auto" on CPU: float32 at most
    per_token = model_kv_bytes_per_token(config, itemsize)
    within_budget = int(env.cpu_kv_cache_gb * (1 << 30)) // (page_size * per_token)
    return min(pages_for_sequences(max_num_seqs, max_model_len, page_size), within_budget)


def step_token_budget(prompts: list[str], max_num_seqs: int, most: int = 512) -> int:
    """`generate`'s tokens per step: the power of two holding the longest prompt (at most `most`),
    so that the warm-up builds no forward program for steps these prompts never take (a 24-byte
    prompt: 6 programs instead of 10). A token of a byte-level tokenizer covers at least one byte
    of UTF-8, so a prompt's bytes, plus a few special tokens, bound its tokens; a prompt past the
    budget is prefilled in chunks, as vLLM does with any long prompt."""
    longest = max(len(prompt.encode()) for prompt in prompts) + 8
    budget = max(16, max_num_seqs, 1 << (longest - 1).bit_length())
    return min(budget, max(most, max_num_seqs))


def _leave_now(code: int) -> None:
    """Ends the process once its output is out, without the interpreter's teardown of JAX, torch
    and vLLM (seconds after a `generate`, spent releasing memory the OS takes back anyway)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def cmd_convert(args: argparse.Namespace) -> int:
    """Writes the prepared weights of `args.model` into `args.out`, a model directory to serve."""
    import jax.numpy as jnp

    from models.checkpoint_kinds import checkpoint_values
    from models.compressed_tensors import METHOD, quantization_config
    from tpu_platform.weights.converted import convert
    from tpu_platform.weights.preparation import Preparation, int8_quantization

    # A compressed-tensors int8 source is int8 as it is (vLLM serves it so): kept, never dequantized.
    source_method = (quantization_config(args.model) or {}).get("quant_method")
    if args.quantization == "int4":
        return _convert_int4(args, source_method)
    if checkpoint_values(args.model) in ("fp8", "int4", "int4z"):
        raise SystemExit(
            f"vllm-xla convert: the source holds {checkpoint_values(args.model)} weights, which a "
            "converted directory does not keep; serve the checkpoint itself (its quantized weights "
            "load as they are)"
        )
    int8 = args.quantization != "none" or source_method == METHOD
    try:
        preparation = Preparation(
            jnp.dtype(args.dtype).name,
            args.packing,
            quantization=int8_quantization(args.model) if int8 else "none",
        )
    except TypeError:
        raise SystemExit(
            f"vllm-xla convert: --dtype {args.dtype!r} is not a dtype (e.g. bfloat16, float32)"
        ) from None
    try:
        checkpoint = convert(args.model, args.out, preparation)
    except ValueError as error:
        raise SystemExit(f"vllm-xla convert: {error}") from None
    serve = " with --quantization int8_per_channel_weight_only" if int8 and source_method != METHOD else ""
    print(f"wrote {preparation.name} weights to {checkpoint}; serve the model directory {args.out}{serve}")
    return 0


def _convert_int4(args: argparse.Namespace, source_method: str | None) -> int:
    """`convert --quantization int4`: a W4A16 compressed-tensors checkpoint of a float one
    (`tpu_platform.weights.int4_convert`; vLLM has no online int4 for a float checkpoint)."""
    from tpu_platform.weights.int4_convert import convert_int4

    if source_method is not None:
        raise SystemExit(
            f"vllm-xla convert: the source is a {source_method} checkpoint; --quantization int4 "
            "quantizes a float one (serve a quantized checkpoint as it is)"
        )
    try:
        quantized = convert_int4(args.model, args.out, args.group_size)
    except ValueError as error:
        raise SystemExit(f"vllm-xla convert: {error}") from None
    print(
        f"wrote {len(quantized)} weights as int4 in groups of {args.group_size} (compressed-tensors "
        f"W4A16) to {args.out}; serve the model directory {args.out} (vLLM reads its method from config.json)"
    )
    return 0


def start_detached(command: list[str]) -> None:
    """Starts `command` in the background as no child of this process: a shell starts it and
    exits, so init reaps it. (This process becomes vLLM's server, which never waits for a child
    it did not start: a direct child would stay a zombie once done.)"""
    subprocess.run(["sh", "-c", '"$@" >/dev/null 2>&1 &', "sh", *command], check=True)


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    _ensure_platform()
    env = read_env()
    if _passes_option("--dtype", extra):
        if _builds_native_kernels(env):  # in a process of its own: this one becomes vLLM's server
            start_detached([sys.executable, "-m", "pallas_kernels.cpu", native_build_dir(env.cache_dir)])
    else:  # as `generate`'s auto: the build tells whether the native dense kernel runs here
        dtype = _auto_dtype("auto", env, _start_native_build(env))
        extra = extra if dtype == "auto" else ["--dtype", dtype, *extra]
    model = args.model or _default_model()
    if args.model is None and not _passes_option("--load-format", extra):
        extra = ["--load-format", "npcache", *extra]  # the embedded model's prepared weights kept
    # vLLM's server entry point starts its engine process with spawn unless told otherwise, which
    # imports vLLM, torch and JAX a second time (most of a server's start). JAX never runs in the front
    # end, so a fork is safe; the platform still spawns where JAX already runs
    # (`plugin_shim.platform._engine_start_method`).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    os.execv(sys.executable, serve_argv(model, extra))
    return 0


def _passes_option(name: str, extra: list[str]) -> bool:
    """Whether vLLM's arguments `extra` set `name` (`--name value` or `--name=value`)."""
    return any(arg.split("=")[0] == name for arg in extra)


# Options that may spread a server over hosts, or start its data-parallel replicas one by one
# (external or hybrid load balancing): the replicas' processes join a liveness link.
_ACROSS_HOSTS = (
    "--nnodes", "--data-parallel-size-local", "-dpl", "--data-parallel-rank", "-dpn",
    "--data-parallel-start-rank", "-dpr", "--data-parallel-external-lb", "-dpe",
    "--data-parallel-hybrid-lb", "-dph",
)  # fmt: skip
# vLLM's supervisor of one external-LB server a local rank (refused: `serve_argv`).
_SUPERVISED_RANKS = ("--data-parallel-multi-port-external-lb", "-dpm")


def serve_argv(model: str, extra: list[str]) -> list[str]:
    """The vLLM command `serve` becomes. vLLM's own options pass through untouched, the multi-node
    ones too (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`, docs/multihost.md). Across
    hosts, or for data-parallel ranks started one by one, vLLM's `serve` subcommand (`--headless`:
    no API server, only the host's worker) through `plugin_shim.vllm_serve`, which ends non-zero
    when a host died and joins data-parallel replicas' processes by a liveness link (which
    `vllm serve` lacks); on one host, vLLM's OpenAI server, as a module (works for every vLLM
    distribution name)."""
    if any(arg.split("=")[0] in _SUPERVISED_RANKS for arg in extra):
        raise SystemExit(
            "vllm-xla serve: --data-parallel-multi-port-external-lb is not supported: vLLM's "
            "supervisor starts each rank's server in a process of its own, which the replicas' "
            "liveness link does not reach; start each rank with its own `vllm-xla serve "
            "--data-parallel-rank R --port P` (--device-ids for its devices) instead"
        )
    if "--headless" in extra or any(arg.split("=")[0] in _ACROSS_HOSTS for arg in extra):
        return [sys.executable, "-m", "plugin_shim.vllm_serve", model, *extra]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *extra]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-xla", description="vLLM on XLA devices (TPU, GPU, CPU) via JAX"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("model-dir", help="materialize the embedded model (or a GGUF) and print its directory")
    p.add_argument("--gguf", help="a GGUF file to convert instead of the embedded SmolLM2-135M-Instruct")
    p = sub.add_parser("generate", help="complete prompts with vllm.LLM on the XLA platform")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    # Small step limits keep the warm-up (one forward program per token bucket) short.
    p.add_argument(
        "--max-num-seqs", type=int, help="default: the number of prompts, at most 16 (fewer sampler programs)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="default: the power of two holding the longest prompt's bytes, at most 512 "
        "(fewer forward programs to build)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's model dtype; auto: bfloat16 on CPUs with AMX, AVX-512 BF16 or AVX2 (the dense "
        "layers then run on the native kernel), else float32 on CPU",
    )
    p = sub.add_parser(
        "serve",
        help="start vLLM's OpenAI-compatible server on the XLA platform (vLLM's options pass through; "
        "without --dtype, generate's auto)",
    )
    p.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    p = sub.add_parser(
        "convert",
        help="write a model's prepared weights (an Orbax checkpoint) into a new model directory, "
        "served as the model on any number of devices",
    )
    p.add_argument("model", help="the source model directory (safetensors or GGUF)")
    p.add_argument("out", help="the new model directory")
    p.add_argument("--dtype", default="bfloat16", help="the weights' dtype; serve with the same --dtype")
    p.add_argument(
        "--packing",
        choices=("none", "native", "native+f32"),
        default="none",
        help="none: for any device (a CPU with the native dense kernel packs after loading); "
        "native: bfloat16 kernels packed for the native CPU dense kernel; native+f32: float32 too",
    )
    p.add_argument(
        "--quantization",
        choices=("none", "int8_per_channel_weight_only", "int4"),
        default="none",
        help="int8_per_channel_weight_only: int8 kernels and their per-channel scales, quantized "
        "once here (serve with the same --quantization: nothing is quantized at start); a "
        "compressed-tensors int8 source is kept int8 without it. int4: a compressed-tensors W4A16 "
        "checkpoint (safetensors, any device or vLLM backend serves it; the LM head stays as it is)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="with --quantization int4: the inputs sharing a scale (a multiple of 8)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command == "serve":
        return cmd_serve(args, extra)
    if extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    commands = {"model-dir": cmd_model_dir, "generate": cmd_generate, "convert": cmd_convert}
    return commands[args.command](args)


def run() -> None:
    """The console script: `main`, then a one-shot `generate` leaves at once (`_leave_now`)."""
    code = main()
    if sys.argv[1:2] == ["generate"]:
        _leave_now(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
