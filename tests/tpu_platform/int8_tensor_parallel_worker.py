# SPDX-License-Identifier: Apache-2.0
"""Run in a process of its own with 8 simulated CPU devices (`test_int8_tensor_parallel.py`).

For one model directory (a float checkpoint quantized at load, or a compressed-tensors int8 one
or a GGUF's Q8_0 weights loaded as they are): streams its int8 weights at TP=1, 2 and 4
(`load_prepared`, in the checkpoint's own int8 layout: `int8_quantization`), and compares each
array bit for bit with the reference, the whole model loaded on the host, prepared at that TP
size and quantized whole in that layout (`load_model` + `quantize_int8`; Q8_0 blocks quantized
again in their groups of 32 give back their own values); records each array's placement, the
loader's peak host bytes, and the prefill logits against the reference's at TP=1. Then converts
it to int8 at TP=1 (`vllm-xla convert --quantization ...`'s `convert`) and restores that at TP=1,
2 and 4, counting the kernels quantized during the restores (none should be). Prints JSON."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models.fp8
import models.int8
from models import ModelConfig, load_model
from models.quantization import quantize_int8
from models.weight_stream import HostBytes
from tests.tpu_platform.tensor_parallel_weights_worker import arrays, describe, prefill_logits, shardings
from tpu_platform.weights.converted import convert, converted_weights, restore_converted
from tpu_platform.weights.preparation import Preparation, int8_quantization
from tpu_platform.weights.prepared import load_prepared

DTYPE = "float32"
PROMPT = [1, 5, 9, 17, 33, 65, 100, 7]


def host_quantized(model_dir: str, tp: int) -> nnx.Module:
    """The reference: the whole model on the host, prepared for `tp`, quantized whole."""
    _, model = load_model(model_dir, jnp.dtype(DTYPE), on_host=True, tp_size=tp)
    quantize_int8(model, Preparation(DTYPE, quantization=int8_quantization(model_dir)).int8_group_size)
    return model


def float_bytes(model_dir: str) -> int:
    """The float model's bytes, as the host would hold it loaded whole."""
    _, model = load_model(model_dir, jnp.dtype(DTYPE), on_host=True)
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model))))


def counting_quantizations(counter: list[int]) -> None:
    """Counts the kernels quantized with concrete values (not `nnx.eval_shape`'s abstract ones)."""
    for module, name in [(models.int8, "quantize"), (models.fp8, "quantize")]:
        original = getattr(module, name)

        def counted(kernel, *args, original=original):
            if not isinstance(kernel, jax.core.Tracer):
                counter[0] += 1
            return original(kernel, *args)

        setattr(module, name, counted)


def main(model_dir: str, scratch: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    config = ModelConfig.from_pretrained(model_dir)
    reference_logits = None
    int8 = int8_quantization(model_dir)
    report: dict = {"float_bytes": float_bytes(model_dir), "tp": {}, "converted": {}, "int8": int8}
    streamed = {}
    for tp in (1, 2, 4):
        expected = arrays(host_quantized(model_dir, tp))
        host_bytes = HostBytes()
        preparation = Preparation(DTYPE, tp_size=tp, quantization=int8)
        _, model = load_prepared(model_dir, preparation, shardings(tp), host_bytes)
        got = streamed[tp] = arrays(model)
        logits = prefill_logits(model, config, tp, PROMPT)
        if tp == 1:
            reference = host_quantized(model_dir, 1)
            nnx.update(reference, jax.device_put(nnx.state(reference), jax.devices()[0]))
            reference_logits = prefill_logits(reference, config, 1, PROMPT)
        report["tp"][str(tp)] = {
            "same_names": sorted(got) == sorted(expected),
            "arrays": {
                name: {
                    **describe(array),
                    "dtype": str(array.dtype),
                    "equal": np.asarray(array).dtype == expected[name].dtype
                    and np.asarray(array).tobytes() == np.ascontiguousarray(expected[name]).tobytes(),
                }
                for name, array in got.items()
            },
            "loader_peak": host_bytes.peak,
            "logits_max_diff": float(np.abs(logits - reference_logits).max()),
            "logits_scale": float(np.abs(reference_logits).max()),
            "same_argmax": bool((logits.argmax(-1) == reference_logits.argmax(-1)).all()),
        }
    out = os.path.join(scratch, "converted")
    convert(model_dir, out, Preparation(DTYPE, quantization=int8))
    quantized = [0]
    counting_quantizations(quantized)
    for tp in (1, 2, 4):  # as the runner serves a converted directory: in the layout it holds
        preparation = Preparation(DTYPE, tp_size=tp, quantization="int8")
        restored = arrays(restore_converted(converted_weights(out), config, preparation, shardings(tp)))
        report["converted"][str(tp)] = {
            "same_names": sorted(restored) == sorted(streamed[tp]),
            "unequal": [
                name
                for name, array in restored.items()
                if array.dtype != streamed[tp][name].dtype
                or np.asarray(array).tobytes() != np.asarray(streamed[tp][name]).tobytes()
                or array.sharding != streamed[tp][name].sharding
            ],
            "int8_kernels": sum(array.dtype == np.int8 for array in restored.values()),
        }
    report["quantized_while_restoring"] = quantized[0]
    load_prepared(model_dir, Preparation(DTYPE, quantization=int8), shardings(1))
    report["quantized_while_streaming"] = quantized[0] - report["quantized_while_restoring"]
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
