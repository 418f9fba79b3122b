# SPDX-License-Identifier: Apache-2.0
"""A pooling engine at `tensor_parallel_size=2` on simulated CPU devices, in a process of its own
(XLA fixes the device count when JAX starts).

`python -m tests.plugin_shim.pooling_tp_engine MODEL TASK OUT.json PROMPTS.json` writes each
prompt's pooled row (embeddings, or class probabilities) and the runner's counters.
"""

from __future__ import annotations

import gc
import json
import sys


def main(model: str, task: str, out_path: str, prompts_path: str) -> None:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    with open(prompts_path) as f:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(f)]
    kwargs = dict(runner="pooling", convert="embed") if task == "embed" else {}
    llm = LLM(
        model=model, tensor_parallel_size=2, dtype="float32", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=64, block_size=16, seed=0, **kwargs,
    )  # fmt: skip
    try:
        if task == "embed":
            rows = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
        else:
            rows = [o.outputs.probs for o in llm.classify(prompts, use_tqdm=False)]
        stats = llm.collective_rpc("runner_stats")[0]
    finally:
        del llm
        gc.collect()
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "stats": stats}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
