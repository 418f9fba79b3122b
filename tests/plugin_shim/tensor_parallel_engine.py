# SPDX-License-Identifier: Apache-2.0
"""vLLM engines at several `tensor_parallel_size`s on 8 simulated CPU devices, in a process of
their own: XLA fixes the CPU device count when JAX starts, and the rest of the suite keeps one.

`python -m tests.plugin_shim.tensor_parallel_engine JOB.json OUT.json` runs each of the job's
runs (one engine each, one after another; a run's own `model`, else the job's: one process can
serve several models in turn, started once) and writes what the tests check: the generated tokens
and their logprobs, the runner's counters, and every parameter's and cache's actual placement
(its PartitionSpec and the bytes each device holds).
"""

from __future__ import annotations

import gc
import json
import os
import sys

from tests.xla_flags import with_host_devices

DEVICES = 8


def placement(worker) -> dict:
    """Each model parameter's and KV cache's PartitionSpec, shape and per-device bytes."""
    import jax

    from models.sharding import key_path_name

    runner = worker.runner

    def describe(array: jax.Array) -> dict:
        spec = getattr(array.sharding, "spec", ())
        return {
            "spec": [None if s is None else str(s) for s in spec],
            "shape": list(array.shape),
            "bytes": int(array.nbytes),
            "device_bytes": sorted(int(s.data.nbytes) for s in array.addressable_shards),
            "devices": len(array.sharding.device_set),
        }

    params = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.state)[0]:
        params[key_path_name(path)] = describe(leaf)
    return {"params": params, "caches": [describe(c) for c in runner.kv_caches]}


def run(model: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, tensor_parallel_size=spec["tp"], **spec["llm"])
    try:
        warm = llm.collective_rpc("runner_stats")[0]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        if spec.get("mixed"):
            import numpy as np

            from tests.plugin_shim.test_strict_compile import _mixed_params

            rng = np.random.default_rng(0)
            llm.generate(prompts, _mixed_params(rng, len(prompts)), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True, logprobs=1)
        # Optional LoRA adapters, one `[name, id, path]` or None a prompt.
        loras = [LoRARequest(*lora) if lora else None for lora in spec.get("loras", [])] or None
        out = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        tokens = [list(o.outputs[0].token_ids) for o in out]
        logprobs = [
            [step[t].logprob for step, t in zip(o.outputs[0].logprobs, ids, strict=True)]
            for o, ids in zip(out, tokens, strict=True)
        ]
        stats = llm.collective_rpc("runner_stats")[0]
        placed = llm.collective_rpc(placement)[0]
        counters = vllm_counters(llm) if spec["llm"].get("disable_log_stats") is False else {}
    finally:
        del llm
        gc.collect()
    return {"tokens": tokens, "logprobs": logprobs, "warm": warm, "stats": stats, "vllm": counters, **placed}


def vllm_counters(llm) -> dict[str, int]:
    """vLLM's own counters (`vllm:prefix_cache_hits`, `vllm:num_preemptions`, ...) of an engine
    started with `disable_log_stats=False`."""
    from vllm.v1.metrics.reader import Counter

    return {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    results = [run(spec.get("model", job.get("model")), spec) for spec in job["runs"]]
    with open(out_path, "w") as f:
        json.dump(results, f)


def environment() -> dict[str, str]:
    """This process's environment for a run: 8 CPU devices, vLLM in-process."""
    return {
        **os.environ,
        "XLA_FLAGS": with_host_devices(DEVICES),
        "JAX_PLATFORMS": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_XLA_PLATFORM": "cpu",
    }


if __name__ == "__main__":
    main(*sys.argv[1:])
