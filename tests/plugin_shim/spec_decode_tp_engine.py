# SPDX-License-Identifier: Apache-2.0
"""A vLLM engine with n-gram speculative decoding at `tensor_parallel_size=2` on simulated CPU
devices, in a process of its own (XLA fixes the CPU device count when JAX starts).

`python -m tests.plugin_shim.spec_decode_tp_engine JOB.json OUT.json`: the job names the model,
the prompts and the token count; the output holds the greedy tokens and the runner's counters.
"""

from __future__ import annotations

import gc
import json
import sys


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(
        model=job["model"], tensor_parallel_size=2, max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=16, seed=0, speculative_config=job["speculative_config"],
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in out],
        "stats": llm.collective_rpc("runner_stats")[0],
    }
    del llm
    gc.collect()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
