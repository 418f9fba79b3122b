# SPDX-License-Identifier: Apache-2.0
"""Run in a process of its own with 2 simulated CPU devices (`test_speculation_tensor_parallel.py`).

`python -m tests.tpu_platform.spec_tp_worker METHOD DIR OUT.json`: builds tiny checkpoints for
METHOD ('draft_model', 'eagle3' or 'mtp') under DIR, serves them at `tensor_parallel_size=2`
through the runner (no vLLM), and drives one request with drafts: a prompt prefilled in two
chunks, then verification steps whose drafts are the proposer's own and drafts made to keep K, 1
and 2 tokens of the target's greedy continuation. Writes, as JSON, every step's output and the
target's greedy tokens (transformers), every step's drafts and the independent reference's
(transformers or the torch references of the heads), where each drafter parameter and cache
went, and the compile count after warm-up.
"""

from __future__ import annotations

import json
import sys

import jax
from flax import nnx

from models.sharding import parameter_spec
from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts
from tests.speculation_driver import PROMPT_LEN, drive, speculating_runner
from tpu_platform.runner import Runner

K = 3
TP = 2
AUX = (0, 2, 3)
VOCAB = 384  # the tiny Llama's and the tiny DeepSeek's


def _llama(path):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def checkpoints(method: str, root: str):
    """(target dir, drafter dir, the target in transformers, `reference(history) -> drafts`)."""
    from tests.tiny_models import save_tiny_eagle3_head, save_tiny_llama

    if method == "mtp":
        import torch
        from transformers import DeepseekV3ForCausalLM

        from tests.models.tiny_deepseek import save_tiny_deepseek_mtp
        from tests.mtp_reference import MtpReference

        path = save_tiny_deepseek_mtp(f"{root}/mtp", seed=5)
        target = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        reference = MtpReference(path, target.eval())
        return path, path, target, lambda history: reference.drafts(history, K)
    target_dir = save_tiny_llama(f"{root}/target", seed=3, num_hidden_layers=4)
    if method == "eagle3":
        from tests.eagle3_reference import Eagle3Reference

        head = save_tiny_eagle3_head(
            f"{root}/head", target_dir, seed=7, aux_layer_ids=AUX, draft_vocab_size=256
        )
        target = _llama(target_dir)
        reference = Eagle3Reference(head, target, AUX)
        return target_dir, head, target, lambda history: reference.drafts(history, K)
    draft_dir = save_tiny_llama(
        f"{root}/draft", seed=4, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1,
    )  # fmt: skip
    draft = _llama(draft_dir)
    return target_dir, draft_dir, _llama(target_dir), lambda history: hf_greedy(draft, history, K)


def build_runner(method: str, target: str, drafter: str) -> Runner:
    return speculating_runner(target, method, drafter, K, tensor_parallel_size=TP)


def drive_request(runner: Runner, target, reference) -> dict:
    """The request's steps: each one's output and drafts beside the references'."""
    (prompt,) = prompts([PROMPT_LEN], seed=5)
    record = drive(runner, target, reference, prompt, K, keeps=(None, K, 1, 2), vocab=VOCAB)
    record.pop("partial")
    return record


def _spec(array: jax.Array) -> list:
    return [None if axis is None else str(axis) for axis in array.sharding.spec]


def placements(runner: Runner) -> dict:
    """Each drafter parameter's PartitionSpec beside the rules table's, and its caches'."""
    draft = runner.speculation.draft
    state = jax.tree.unflatten(draft._state_def, draft._state_leaves)
    params = {}
    for key, value in nnx.to_flat_state(state):
        path, array = ".".join(map(str, key)), value.get_value()
        rule = [None if axis is None else str(axis) for axis in parameter_spec(path, array.shape, TP)]
        params[path] = {"spec": _spec(array), "rule": rule, "devices": len(array.sharding.device_set)}
    caches = [
        {"spec": _spec(c), "shape": list(c.shape), "shard": list(c.addressable_shards[0].data.shape)}
        for c in draft.kv_caches
    ]
    return {"params": params, "caches": caches}


def main(method: str, root: str, out_path: str) -> None:
    target_dir, drafter_dir, target, reference = checkpoints(method, root)
    runner = build_runner(method, target_dir, drafter_dir)
    result = drive_request(runner, target, reference)
    result.update(placements(runner))
    result["compiles_after_warmup"] = runner.programs.compiles_after_warmup
    result["stats"] = {
        "draft": runner.speculation.stats.draft_tokens,
        "kept": runner.speculation.stats.accepted_tokens,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
