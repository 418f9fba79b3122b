# SPDX-License-Identifier: Apache-2.0
"""What serving LoRA adapters costs: generation throughput of the embedded SmolLM2-135M on our
platform without LoRA, with LoRA enabled but every request on the base model, and with the
requests spread over `--adapters` random adapters (every q/k/v/o and gate/up/down projection).

    .venv/bin/python benchmarks/lora.py [--out benchmarks/out/lora.json] [--requests 32]
        [--prompt 64] [--tokens 64] [--adapters 4] [--rank 16]

Each configuration runs in its own subprocess (this script with `--worker`): vLLM's `LLM`
in-process, `--requests` prompts of `--prompt` random ids, `--tokens` greedy tokens each
(`ignore_eos`), one `generate` call timed after a warm-up request per adapter (each adapter is
read and in a device slot before the timing). The LoRA engines use
`max_loras = --adapters` and `max_lora_rank = --rank`. Prints output tokens/s per configuration
and its ratio to the base engine, and the same per CPU-second of the engine's process (the work
done, which other load on a shared machine disturbs less than the wall clock), and writes the
JSON (with the runner's compile counters).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CONFIGS = ("base", "lora_base_rows", "lora_mixed")


def write_adapters(model_dir: str, root: str, count: int, rank: int) -> list[str]:
    """`count` random PEFT adapters of `rank` on every dense projection of the model at `model_dir`."""
    import numpy as np
    from safetensors.numpy import save_file

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    d, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
        "self_attn.o_proj": (q, d), "mlp.gate_proj": (d, inter), "mlp.up_proj": (d, inter),
        "mlp.down_proj": (inter, d),
    }  # fmt: skip
    paths = []
    for k in range(count):
        rng = np.random.default_rng(k)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (n_in, n_out) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(np.float32)
        path = os.path.join(root, f"adapter{k}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        targets = [m.split(".")[1] for m in shapes]
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}, f)
        paths.append(path)
    return paths


def worker(args: argparse.Namespace) -> dict:
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = args.worker != "base"
    engine = dict(max_model_len=512, max_num_seqs=args.requests, max_num_batched_tokens=1024, seed=0)
    if lora:
        engine.update(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    start = time.perf_counter()
    llm = LLM(model=args.model, **engine)
    startup = time.perf_counter() - start
    rng = np.random.default_rng(0)
    prompts = [
        TokensPrompt(prompt_token_ids=rng.integers(10, 8000, args.prompt).tolist())
        for _ in range(args.requests)
    ]
    loras, adapters = None, []
    if args.worker == "lora_mixed":
        adapters = [LoRARequest(f"adapter{k}", k + 1, p) for k, p in enumerate(args.adapter_paths)]
        loras = [adapters[i % len(adapters)] for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    # Warm-up: one request per adapter, so every adapter is read and in its slot before the timing.
    warm = len(adapters) if loras else 1
    llm.generate(
        prompts[:warm],
        SamplingParams(max_tokens=4),
        use_tqdm=False,
        lora_request=loras[:warm] if loras else None,
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    out = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stats = llm.collective_rpc("runner_stats")[0]
    generated = sum(len(o.outputs[0].token_ids) for o in out)
    return {
        "config": args.worker, "startup_s": startup, "wall_s": wall, "output_tokens": generated,
        "output_tokens_per_s": generated / wall, "cpu_s": cpu,
        "output_tokens_per_cpu_s": generated / cpu, "compiles": stats["compiles"],
        "compiles_after_warmup": stats["compiles_after_warmup"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(HERE / "out" / "lora.json"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--adapter-paths", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    from _peers import gguf_model_dir

    os.environ.setdefault("VLLM_XLA_PLATFORM", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = gguf_model_dir()
    results = []
    with tempfile.TemporaryDirectory() as root:
        paths = write_adapters(model, root, args.adapters, args.rank)
        for config in CONFIGS:
            command = [
                sys.executable,
                __file__,
                "--worker",
                config,
                "--model",
                model,
                "--adapter-paths",
                *paths,
            ]
            for name in ("requests", "prompt", "tokens", "adapters", "rank"):
                command += [f"--{name}", str(getattr(args, name))]
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                print(f"{config} failed:\n{done.stderr[-3000:]}")
                continue
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
            print(f"{config}: {results[-1]}", flush=True)  # each as it ends: a long run shows progress
    base = next((r for r in results if r["config"] == "base"), None)
    header = ("config", "out tok/s", "vs base", "tok/cpu-s", "vs base", "late compiles")
    print("{:<16} {:>10} {:>8} {:>10} {:>8} {:>14}".format(*header))
    for r in results:
        rate, per_cpu = r["output_tokens_per_s"], r["output_tokens_per_cpu_s"]
        ratio = rate / base["output_tokens_per_s"] if base else float("nan")
        cpu_ratio = per_cpu / base["output_tokens_per_cpu_s"] if base else float("nan")
        late = r["compiles_after_warmup"]
        print(f"{r['config']:<16} {rate:>10.1f} {ratio:>8.2f} {per_cpu:>10.1f} {cpu_ratio:>8.2f} {late:>14}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"args": {k: v for k, v in vars(args).items() if k != "adapter_paths"}, "results": results},
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
