# SPDX-License-Identifier: Apache-2.0
"""One of two JAX hosts (processes on this machine) loading the same LoRA adapters, each from its
own path: prints, as JSON, what every step gave on this host (`test_lora_hosts.py`).

Usage: lora_hosts_worker.py RANK PORT MODEL_DIR GOOD_ADAPTER MISSING_ON_HOST_1 OTHER_ON_HOST_1
(the last two: this host's path of an adapter host 1 lacks, and of one it holds other files of)"""

import json
import sys


def main(rank: int, port: int, model_dir: str, good: str, missing: str, other: str) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import load_model
    from models.lora import attach_lora
    from tpu_platform.hosts import HostGroup, agree_across_hosts, join_hosts
    from tpu_platform.lora_slots import LoraConfig, LoraSlots

    join_hosts(HostGroup(f"127.0.0.1:{port}", 2, rank, timeout_seconds=60), "cpu")
    gathered = agree_across_hosts("too long " * 200 if rank else None, bytes([rank, 7]))
    report = {"gathered": [(error, list(digest)) for error, digest in gathered]}
    _, model = load_model(model_dir)
    config = LoraConfig(max_loras=1, max_lora_rank=4)
    sites = attach_lora(model, max_loras=1, max_rank=4, dtype=jnp.float32)
    state = jax.device_put(nnx.state(model), jax.local_devices()[0])
    slots = LoraSlots(config, sites, state, jax.tree.leaves(state))  # agrees across the hosts
    for lora_id, name, path in ((1, "missing", missing), (3, "other", other)):
        try:
            slots.add(lora_id, name, path)
            report[name] = "loaded"
        except ValueError as error:
            report[name] = str(error)
    report["good"] = slots.add(2, "same", good)
    report["ids"] = sorted(slots.ids())
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])
