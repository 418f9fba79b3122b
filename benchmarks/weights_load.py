# SPDX-License-Identifier: Apache-2.0
"""The runner's model load, by where the weights come from: the checkpoint, the prepared-weights
cache (`load_format="npcache"`, an Orbax checkpoint) and a converted model directory.

    .venv/bin/python benchmarks/weights_load.py [--out benchmarks/results/weights_load.json]
        [--model DIR] [--dtype bfloat16] [--repeats 3]

Each load runs in a fresh subprocess (imports and Orbax's first use included, as at a start):
`Runner.load_model` on the embedded SmolLM2-135M-Instruct (default) with a scratch cache
directory, first from the checkpoint (`auto`), then `npcache` once cold (it stores the entry) and
`--repeats` times warm, then `--repeats` times from a directory `vllm-xla convert` wrote. Printed
and written as JSON: seconds per load, and the median of each kind.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent

_LOAD = """
import json, sys, time
import jax
from tpu_platform.runner import Runner
from tpu_platform.runner_config import RunnerConfig
model, cache_dir, load_format, dtype = sys.argv[1:5]
runner = Runner(RunnerConfig(
    model_path=model, dtype=dtype, cache_dir=cache_dir, load_format=load_format, attention_backend="auto",
    page_size=16, max_model_len=2048, max_num_seqs=2, max_num_batched_tokens=16))
start = time.perf_counter()
runner.load_model()
jax.block_until_ready(runner._state_leaves)
print("LOAD " + json.dumps({"seconds": time.perf_counter() - start}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "weights_load.json"))
    parser.add_argument("--model", help="a model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def load_seconds(model: str, cache_dir: str, load_format: str, dtype: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, model, cache_dir, load_format, dtype],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.split("LOAD ", 1)[1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="weights_load-") as scratch:
        model = args.model
        if model is None:
            from plugin_shim.model_dir import materialize
            from tpu_platform.envs import read_env

            model = materialize(read_env().cache_dir)
        cache_dir = os.path.join(scratch, "cache")
        converted = os.path.join(scratch, "converted")
        subprocess.run(
            [sys.executable, "-m", "plugin_shim.cli", "convert", model, converted, "--dtype", args.dtype],
            env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, capture_output=True,
        )  # fmt: skip
        runs: dict[str, list[float]] = {
            "checkpoint": [],
            "npcache cold": [],
            "npcache warm": [],
            "converted": [],
        }
        load_seconds(model, cache_dir, "auto", args.dtype)  # builds the native kernels: not timed
        runs["checkpoint"].append(load_seconds(model, cache_dir, "auto", args.dtype))
        runs["npcache cold"].append(load_seconds(model, cache_dir, "npcache", args.dtype))
        for _ in range(args.repeats):
            runs["npcache warm"].append(load_seconds(model, cache_dir, "npcache", args.dtype))
            runs["converted"].append(load_seconds(converted, cache_dir, "auto", args.dtype))
    result = {
        "model": model,
        "dtype": args.dtype,
        "seconds": runs,
        "median_seconds": {kind: statistics.median(times) for kind, times in runs.items()},
        "load_average": os.getloadavg(),
    }
    for kind, times in runs.items():
        print(
            f"{kind:>14}: median {statistics.median(times):.2f} s  ({', '.join(f'{t:.2f}' for t in times)})"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
