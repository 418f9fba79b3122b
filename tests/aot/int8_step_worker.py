# SPDX-License-Identifier: Apache-2.0
"""Compile worker: the runner's decode step (64 sequences, one token each) or a prefill step
(one sequence's 512-token chunk) with bfloat16 and with int8 weights (the served layout: fused
projections, `Preparation(quantization="int8")`; `int8-g32`: scales per group of 32 inputs, a
GGUF's Q8_0 layout) for one chip of a compile-only target, weights
abstract. Prints one JSON line: per case, the weights' bytes, the compiled
program's memory analysis and the optimized-HLO buffers at least as large as the largest
int8 kernel (a bfloat16 copy of a weight would show there).

    python -m tests.aot.int8_step_worker TARGET:MODEL:{bfloat16,int8,int8-g32}[:prefill] ...
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from models import attach_rope_tables
from tests.aot.step_compile import large_buffers
from tpu_platform.inputs import pack_inputs, padding_inputs
from tpu_platform.kv_cache import allocate_stacked_caches, caches_per_array, kv_cache_dtype
from tpu_platform.plan import StepSetup, kv_layout, model_config, program_facts
from tpu_platform.prepared_weights import Preparation, abstract_prepared
from tpu_platform.step import make_forward
from tpu_platform.targets import compile_only_devices

DECODE_TOKENS = 64
PREFILL_TOKENS = 512
NUM_PAGES = 256


def compile_case(case: str) -> dict:
    target_name, model, variant, *phase = case.split(":")
    prefill = phase == ["prefill"]
    setup = StepSetup(model_config(model), target_name, max_num_seqs=DECODE_TOKENS, max_model_len=2048)
    config, layout = setup.config, kv_layout(setup.config)
    preparation = Preparation("bfloat16", quantization="none" if variant == "bfloat16" else variant)
    graphdef, state = abstract_prepared(config, preparation)
    model_ = nnx.merge(graphdef, state)
    attach_rope_tables(model_, setup.max_model_len)
    graphdef, state = nnx.split(model_)
    leaves, state_def = jax.tree.flatten(state)
    kv_dtype = kv_cache_dtype(setup.cache_dtype)
    caches = jax.eval_shape(
        lambda: allocate_stacked_caches(
            layout.num_caches, NUM_PAGES, setup.tokens_per_page, config.num_kv_heads, config.head_dim,
            kv_dtype, setup.backend,
        )
    )  # fmt: skip
    per_array = caches_per_array(layout.num_caches, NUM_PAGES, setup.tokens_per_page)
    forward = make_forward(
        graphdef, state_def, setup.backend, layout.layer_groups, layout.layer_caches, kv_dtype.name,
        cache_pages=NUM_PAGES, caches_per_array=per_array,
    )  # fmt: skip
    tokens, seqs = (PREFILL_TOKENS, 1) if prefill else (DECODE_TOKENS, DECODE_TOKENS)
    t_pad, r_pad, p_pad = setup.buckets.shape_for(tokens, seqs)
    packed, dims = pack_inputs(padding_inputs(t_pad, r_pad, p_pad, layout.num_groups))
    device = compile_only_devices(target_name)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
        (list(leaves), caches, packed, np.zeros(setup.buckets.max_seqs, np.int32)),
    )
    start = time.perf_counter()
    with jax.default_device(device):
        compiled = forward.trace(*args, dims=dims).lower().compile()
    facts = program_facts(compiled, time.perf_counter() - start)
    int8_kernels = [leaf for leaf in leaves if leaf.dtype == np.int8]
    largest = max((leaf.size for leaf in int8_kernels), default=0)
    return {
        "case": case,
        "tokens": t_pad,
        "weight_bytes": int(sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)),
        "int8_leaves": len(int8_kernels),
        "large_buffers": large_buffers(compiled.as_text(), largest) if largest else [],
        **facts.as_dict(),
    }


def main(cases: list[str]) -> None:
    print(json.dumps([compile_case(case) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1:])
