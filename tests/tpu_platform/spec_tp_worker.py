# SPDX-License-Identifier: Apache-2.0
"""Run in a process of its own with 2 simulated CPU devices (`test_speculation_tensor_parallel.py`).

`python -m tests.tpu_platform.spec_tp_worker METHOD DIR OUT.json`: builds tiny checkpoints for
METHOD ('draft_model', 'eagle', 'eagle3', 'mtp', 'hybrid_mtp': a Qwen3-Next target's own MTP layer, or
'hybrid_eagle3': an EAGLE-3 head reading a Qwen3-Next target's Gated DeltaNet and attention layers)
under DIR, serves them at `tensor_parallel_size=2`
through the runner (no vLLM), and drives one request with drafts: a prompt prefilled in two
chunks, then verification steps whose drafts are the proposer's own and drafts made to keep K, 1
and 2 tokens of the target's greedy continuation (the hybrid target: none, 1, all and none, each
Gated DeltaNet layer keeping a state after each verified row). Writes, as JSON, every step's output and the
target's greedy tokens (transformers), every step's drafts and the independent reference's
(transformers or the torch references of the heads), where each drafter parameter and cache
went (a hybrid target's state pools too), and the compile count after warm-up.
"""

from __future__ import annotations

import json
import sys

import jax
from flax import nnx

from models.sharding import MODEL_AXIS, parameter_spec
from pallas_kernels import state_partition_specs
from tests.greedy_reference import hf_greedy
from tests.models.tiny_checkpoints import prompts
from tests.speculation_driver import PROMPT_LEN, drive, speculating_runner
from tpu_platform.runner import Runner
from tpu_platform.step_program import KVLayout

K = 3
TP = 2
AUX = (0, 2, 3)
HYBRID_AUX = (1, 3, 4)  # two Gated DeltaNet layers' outputs and the full-attention one's
HYBRID = ("hybrid_mtp", "hybrid_eagle3")
VOCAB = 384  # the tiny Llama's and the tiny DeepSeek's


def _llama(path):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def checkpoints(method: str, root: str):
    """(target dir, drafter dir, the target in transformers, `reference(history) -> drafts`)."""
    from tests.tiny_models import save_tiny_eagle3_head, save_tiny_llama

    if method == "hybrid_mtp":
        import torch
        from transformers import Qwen3NextForCausalLM

        from tests.models.tiny_qwen3_next import save_tiny_qwen3_next_mtp
        from tests.qwen_mtp_reference import QwenMtpReference

        path = save_tiny_qwen3_next_mtp(f"{root}/hybrid", seed=5)
        target = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        reference = QwenMtpReference(path, target.eval())
        return path, path, target, lambda history: reference.drafts(history, K)
    if method == "hybrid_eagle3":
        import torch
        from transformers import Qwen3NextForCausalLM

        from tests.eagle3_reference import Eagle3Reference
        from tests.models.tiny_qwen3_next import save_tiny_qwen3_next

        path = save_tiny_qwen3_next(f"{root}/hybrid", seed=5)
        head = save_tiny_eagle3_head(
            f"{root}/head", path, seed=7, aux_layer_ids=HYBRID_AUX, draft_vocab_size=256
        )
        target = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        reference = Eagle3Reference(head, target.eval(), HYBRID_AUX)
        return path, head, target, lambda history: reference.drafts(history, K)
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
    if method == "eagle":
        from tests.eagle_reference import EagleReference
        from tests.tiny_models import save_tiny_eagle_head

        head = save_tiny_eagle_head(f"{root}/head", target_dir, seed=7, fc_bias=True)
        reference = EagleReference(head, _llama(target_dir))
        return target_dir, head, _llama(target_dir), lambda history: reference.drafts(history, K)
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
    if method not in HYBRID:
        return speculating_runner(target, method, drafter, K, tensor_parallel_size=TP)
    # The engine's groups for 3 Gated DeltaNet layers and 1 full-attention one: a group each.
    layout = lambda runner: KVLayout.for_model(runner.model_config)  # noqa: E731
    proposer = method.removeprefix("hybrid_")
    return speculating_runner(
        target, proposer, drafter, K, tensor_parallel_size=TP, num_pages=20, layout=layout
    )


def drive_request(runner: Runner, target, reference, hybrid: bool) -> dict:
    """The request's steps: each one's output and drafts beside the references'. A hybrid
    target's request has 1 + K state blocks in each state group (its KV pages in the full one)."""
    (prompt,) = prompts([PROMPT_LEN], seed=5)
    keeps = (0, 1, K, 0) if hybrid else (None, K, 1, 2)
    blocks = [[1 + g + 4 * j for j in range(1 + K)] for g in range(4)] if hybrid else None
    record = drive(runner, target, reference, prompt, K, keeps=keeps, vocab=VOCAB, blocks=blocks)
    record.pop("partial")
    return record


def _spec_list(spec) -> list:
    """A PartitionSpec as JSON, without trailing unsplit axes (which JAX may drop or keep)."""
    axes = [None if axis is None else str(axis) for axis in spec]
    while axes and axes[-1] is None:
        axes.pop()
    return axes


def _spec(array: jax.Array) -> list:
    return _spec_list(array.sharding.spec)


def placements(runner: Runner) -> dict:
    """Each drafter parameter's PartitionSpec beside the rules table's, and its caches'."""
    draft = runner.speculation.draft
    state = jax.tree.unflatten(draft._state_def, draft._state_leaves)
    params = {}
    for key, value in nnx.to_flat_state(state):
        path, array = ".".join(map(str, key)), value.get_value()
        rule = _spec_list(parameter_spec(path, array.shape, TP))
        params[path] = {"spec": _spec(array), "rule": rule, "devices": len(array.sharding.device_set)}
    caches = [
        {"spec": _spec(c), "shape": list(c.shape), "shard": list(c.addressable_shards[0].data.shape)}
        for c in draft.kv_caches
    ]
    return {"params": params, "caches": caches}


def state_pools(runner: Runner) -> list[dict]:
    """Each Gated DeltaNet layer's conv and recurrent pools: PartitionSpec beside
    `pallas_kernels.state_partition_specs`', shape and one device's shard."""
    layout = runner.step_program.layout
    caches = jax.tree.unflatten(layout.caches_def, runner.kv_caches)
    rules = [_spec_list(rule) for rule in state_partition_specs(MODEL_AXIS)]
    return [
        {"spec": _spec(pool), "rule": rule, "shape": list(pool.shape),
         "shard": list(pool.addressable_shards[0].data.shape)}
        for i in layout.state_layers
        for pool, rule in zip(caches[i], rules, strict=True)
    ]  # fmt: skip


def main(method: str, root: str, out_path: str) -> None:
    target_dir, drafter_dir, target, reference = checkpoints(method, root)
    runner = build_runner(method, target_dir, drafter_dir)
    result = drive_request(runner, target, reference, method in HYBRID)
    result.update(placements(runner))
    if method in HYBRID:
        result["state_pools"] = state_pools(runner)
        result["state_columns"] = runner.step_program.layout.state_columns
    result["compiles_after_warmup"] = runner.programs.compiles_after_warmup
    result["stats"] = {
        "draft": runner.speculation.stats.draft_tokens,
        "kept": runner.speculation.stats.accepted_tokens,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
