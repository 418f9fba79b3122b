# SPDX-License-Identifier: Apache-2.0
"""One of two JAX hosts (processes on this machine, 2 simulated CPU devices each, gloo
collectives) serving one tiny MoE checkpoint with its experts split by index over the 4 devices
of both (`test_expert_parallel_hosts.py`): the runner's placement (`weight_sharding` with
`expert_parallel=True`, the layers told by `use_expert_parallel`) on the mesh the hosts build
(`tensor_parallel_mesh`). Prints `REPORT {json}`: the greedy tokens of each prompt, the bytes
this host read of each checkpoint tensor (`tests.models.counted_reads`) and, for each expert
array, the expert indices this host's devices hold and each device's share's shape.

Usage: expert_parallel_hosts_worker.py RANK PORT MODEL_DIR NEW_TOKENS PROMPTS_JSON"""

import json
import sys


def held_experts(array) -> list[list[int]]:
    """The expert indices each of this host's devices holds of `array` (`[E, ...]`)."""
    return sorted(list(range(*s.index[0].indices(array.shape[0]))) for s in array.addressable_shards)


def greedy_across_hosts(model, config, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens after `prompt` at TP=4 (the logits, split over the vocabulary, gathered to
    every host)."""
    import functools

    from jax.experimental.multihost_utils import process_allgather

    from tests.tpu_platform.tensor_parallel_weights_worker import greedy

    gathered = functools.partial(process_allgather, tiled=True)
    return greedy(model, config, 4, prompt, new_tokens, to_host=gathered)


def main(rank: int, port: int, model_dir: str, new_tokens: int, prompts: list[list[int]]) -> None:
    import functools

    from models import ModelConfig
    from models.moe import use_expert_parallel
    from tests.models.counted_reads import counting_reads
    from tests.tpu_platform.tensor_parallel_weights_worker import arrays
    from tpu_platform.hosts import HostGroup, join_hosts
    from tpu_platform.mesh import tensor_parallel_mesh
    from tpu_platform.runner_state import weight_sharding
    from tpu_platform.weights.preparation import Preparation
    from tpu_platform.weights.prepared import load_prepared

    join_hosts(HostGroup(f"127.0.0.1:{port}", 2, rank, timeout_seconds=60), "cpu")
    sharding = functools.partial(weight_sharding, tensor_parallel_mesh(4), expert_parallel=True)
    with counting_reads() as read:
        _, model = load_prepared(model_dir, Preparation("float32", tp_size=4), sharding)
    report = {"flagged": use_expert_parallel(model), "read": read}
    config = ModelConfig.from_pretrained(model_dir)
    report["tokens"] = [greedy_across_hosts(model, config, prompt, new_tokens) for prompt in prompts]
    report["experts"] = {
        name: {"held": held_experts(array), "shares": [list(s.data.shape) for s in array.addressable_shards]}
        for name, array in arrays(model).items()
        if ".experts." in f".{name}."
    }
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]))
