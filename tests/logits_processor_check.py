# SPDX-License-Identifier: Apache-2.0
"""Installs a tiny logits-processor package with an entry point, then runs vLLM on our platform.

`python -m tests.logits_processor_check MODEL_DIR WORK_DIR` prints a JSON line. It runs in its own
process so the installed entry point cannot leak into other tests.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

PROCESSOR = textwrap.dedent(
    '''
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor


    class ForceTokenProcessor(LogitsProcessor):
        """Rows whose request has extra_args["force_token"] = t may only produce token t."""

        instances = 0

        def __init__(self, vllm_config, device, is_pin_memory):
            ForceTokenProcessor.instances += 1
            self.forced = {}

        @classmethod
        def validate_params(cls, params):
            token = (params.extra_args or {}).get("force_token")
            if token is not None and not isinstance(token, int):
                raise ValueError("force_token must be an int")

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.forced.pop(index, None)
            for index, params, _, _ in batch_update.added:
                token = (params.extra_args or {}).get("force_token")
                if token is None:
                    self.forced.pop(index, None)
                else:
                    self.forced[index] = token

        def apply(self, logits):
            for index, token in self.forced.items():
                if index < logits.shape[0]:
                    keep = logits[index, token].clone()
                    logits[index] = float("-inf")
                    logits[index, token] = keep
            return logits
    '''
)


def install(work_dir: str) -> None:
    """A package `forcetok` plus dist-info with a `vllm.logits_processors` entry point."""
    os.makedirs(os.path.join(work_dir, "forcetok"), exist_ok=True)
    with open(os.path.join(work_dir, "forcetok", "__init__.py"), "w") as f:
        f.write(PROCESSOR)
    info = os.path.join(work_dir, "forcetok-0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: forcetok\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.logits_processors]\nforce_token = forcetok:ForceTokenProcessor\n")
    sys.path.insert(0, work_dir)


def main(model_dir: str, work_dir: str) -> None:
    install(work_dir)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from plugin_shim.active import assert_active

    llm = LLM(model=model_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    assert_active()
    prompt = TokensPrompt(prompt_token_ids=[1, 5, 9, 20, 33])
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    forced = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, extra_args={"force_token": 42})
    outputs = llm.generate([prompt, prompt], [plain, forced], use_tqdm=False)
    rejected = ""
    try:
        llm.generate([prompt], SamplingParams(max_tokens=2, extra_args={"force_token": "x"}), use_tqdm=False)
    except Exception as e:  # the front end turns validate_params' ValueError into a request error
        rejected = str(e)
    import forcetok

    result = {
        "plain": list(outputs[0].outputs[0].token_ids),
        "forced": list(outputs[1].outputs[0].token_ids),
        "instances": forcetok.ForceTokenProcessor.instances,
        "rejected": rejected,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
