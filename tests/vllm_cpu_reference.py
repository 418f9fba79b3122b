# SPDX-License-Identifier: Apache-2.0
"""Runs the shared sampling cases on vLLM's own CPU backend; prints JSON (used in a subprocess).

`python -m tests.vllm_cpu_reference MODEL_DIR`: `VLLM_TARGET_DEVICE=cpu` makes vLLM ignore every
platform plugin, so this is an independent reference for our platform.
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = [[1, 5, 9, 20, 33, 7], [1, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]]
CASES = {
    "greedy_logprobs": dict(temperature=0.0, max_tokens=10, logprobs=3),
    "penalties": dict(
        temperature=0.0, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4
    ),
    "logit_bias": dict(temperature=0.0, max_tokens=8, logit_bias={100: 30.0, 101: 5.0}),
    "allowed": dict(temperature=0.0, max_tokens=8, allowed_token_ids=[7, 8, 9, 10, 11]),
    "min_tokens": dict(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=[2]),
    "prompt_logprobs": dict(temperature=0.0, max_tokens=2, prompt_logprobs=2),
    "bad_words": dict(temperature=0.0, max_tokens=10, bad_words=["hello", " the quick"]),
}


def run_cases(llm) -> dict:
    """Token ids (and top logprobs, when asked) of every case, for every prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    results = {}
    for name, kwargs in CASES.items():
        params = SamplingParams(ignore_eos=name != "min_tokens", **kwargs)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        results[name] = [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [
                    {str(t): lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])
                ],
                "prompt_logprobs": [
                    {str(t): lp.logprob for t, lp in step.items()} for step in (o.prompt_logprobs or [])[1:]
                ],
            }
            for o in outputs
        ]
    return results


def main(model_dir: str) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.pop("VLLM_XLA_PLATFORM", None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    # Eager: the reference is vLLM's CPU model code and sampler; compiling it with torch.compile
    # (the CPU backend's default) took most of the reference's start and changes no token.
    llm = LLM(model=model_dir, max_model_len=256, dtype="float32", max_num_seqs=4, seed=0, enforce_eager=True)
    print("RESULTS " + json.dumps(run_cases(llm)))


if __name__ == "__main__":
    main(sys.argv[1])
