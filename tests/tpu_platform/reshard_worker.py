# SPDX-License-Identifier: Apache-2.0
"""Run in a process of its own with 8 simulated CPU devices (`test_prepared_weights.py`): saves a
model's prepared state sharded 2-way on each weight's output axis, restores it 1-way and 4-way,
and prints, as JSON, what every restored array is (spec, bytes per device, equal bit for bit to
the host arrays)."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import load_model
from tpu_platform.weights.preparation import Preparation
from tpu_platform.weights.prepared import metadata_for, restore_prepared, save_prepared


def output_axis_sharding(ways: int):
    """Each weight of two or more axes split `ways`-way on its last (output) axis, others replicated."""
    mesh = Mesh(np.array(jax.devices()[:ways]), ("model",))

    def sharding(path: tuple[str, ...], leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        spec = (
            PartitionSpec(*([None] * (len(leaf.shape) - 1)), "model")
            if len(leaf.shape) >= 2
            else PartitionSpec()
        )
        return NamedSharding(mesh, spec)

    return sharding


def main(model_dir: str, checkpoint: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    preparation = Preparation("bfloat16")
    config, model = load_model(model_dir, jnp.bfloat16, on_host=True)
    host = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    saved_sharding = output_axis_sharding(2)
    state = jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.device_put(x, saved_sharding((), x)), nnx.state(model)
    )
    kernels = [x for x in jax.tree.leaves(state) if x.ndim >= 2]
    assert all(x.addressable_shards[0].data.nbytes * 2 == x.nbytes for x in kernels)  # saved 2-way
    save_prepared(checkpoint, state, metadata_for(config, preparation, state))
    report = {}
    for ways in (1, 4):
        restored = restore_prepared(checkpoint, config, preparation, output_axis_sharding(ways))
        for path, var in nnx.to_flat_state(nnx.state(restored)):
            name = ".".join(map(str, path))
            array = var.get_value()
            shard_bytes = sorted({s.data.nbytes for s in array.addressable_shards})
            report[f"{ways}:{name}"] = {
                "spec": [axis for axis in array.sharding.spec],
                "devices": len(array.sharding.device_set),
                "shard_bytes": shard_bytes,
                "bytes": array.nbytes,
                "equal": array.dtype == host[name].dtype
                and np.asarray(array).tobytes() == host[name].tobytes(),
            }
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
