# SPDX-License-Identifier: Apache-2.0
"""A vLLM engine in a process whose `sys.path` holds an installed out-of-tree model package
(`examples/flax_model_plugin`): vLLM discovers its `vllm.general_plugins` entry point there.

`python -m tests.plugin_shim.flax_plugin_engine JOB.json OUT.json` serves the job's model with
`vllm.LLM` (greedy tokens of its prompts), then asks vLLM's configuration for a checkpoint
whose architecture nothing serves here, and writes the tokens and that refusal.
"""

from __future__ import annotations

import gc
import json
import sys


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(model=job["model"], **job["llm"])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in out]
        architecture = llm.collective_rpc(lambda worker: type(worker.runner.model_config).__name__)[0]
    finally:
        del llm
        gc.collect()
    try:
        EngineArgs(model=job["unserved_model"], max_model_len=64).create_engine_config()
        refusal = None
    except ValueError as error:  # pydantic's ValidationError is one
        refusal = str(error)
    with open(out_path, "w") as f:
        json.dump({"tokens": tokens, "config_class": architecture, "refusal": refusal}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
