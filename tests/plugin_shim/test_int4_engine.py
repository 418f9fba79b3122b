# SPDX-License-Identifier: Apache-2.0
"""4-bit weights end to end through `vllm.LLM`: a compressed-tensors W4A16 checkpoint written by
the compressed-tensors package (one scale per 128 inputs of each channel), its method read from
config.json, generates greedily what transformers (float32) does on the package's own
decompressed weights, and a 4-bit GPTQ one (`gptq_checkpoints`) what it does on its dequantized
weights, its projections held as int4 on the device; an AWQ one (`awq_checkpoints`, zero
points: int4 values with an offset per group, `models.int4`) likewise.
The engine's activations are
bfloat16, so a generated token must be transformers' argmax after the same tokens or within
`TIE` of it (`test_fp8_engine`). On 2 simulated devices it generates what it does on one, each
device holding half of each split kernel and whole groups of its scales (and, for AWQ, of its
offsets). An AWQ Qwen3-MoE (Qwen3-30B-A3B-AWQ's layout: every expert with zero points) generates
what transformers does on its dequantized weights; with zero points at TP=2 and EP=2 it
generates what it does on one device.
"""

import gc
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from models import PackedKernel, int4
from models.linear import is_packed_int4
from tests.models.awq_checkpoints import write_awq
from tests.models.fp8_checkpoints import write_float
from tests.models.gptq_checkpoints import write_gptq
from tests.models.int4_checkpoints import write_compressed_w4a16, write_decompressed, write_packed_w4a16
from tests.models.tiny_checkpoints import prompts as random_prompts
from tests.models.tiny_checkpoints import save_tiny
from tests.models.trained_tiny import save_trained_tiny, text_ids
from tests.plugin_shim.tensor_parallel_engine import environment
from tests.plugin_shim.test_fp8_engine import _ENGINE, NEW_TOKENS, _assert_greedy_of, _transformers

pytestmark = pytest.mark.slow  # engines


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("int4_engine")


@pytest.fixture(scope="module")
def source(root):
    """A tiny Llama trained on the fixed text (hidden 128, 8 heads of 32, intermediate 256: whole
    128-input groups, two where a projection's inputs split over 2 devices)."""
    widths = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, head_dim=32)
    return save_trained_tiny("LlamaForCausalLM", str(root / "float"), **widths)


@pytest.fixture(scope="module")
def checkpoint(source, root):
    return write_compressed_w4a16(source, str(root / "w4a16"), group_size=128)


@pytest.fixture(scope="module")
def prompts(checkpoint):
    ids = text_ids(checkpoint)
    return [ids[:12], ids[40:61], ids[100:107]]


def _int4_kernels(worker) -> int:
    """How many of the engine's kernels hold 4-bit values: packed two a byte for the native int4
    kernel (`models.linear.is_packed_int4`), or int8 ones (`int4.held_dtype`) each in [-8, 7]. A
    stack of every layer's packed kernels (`models.layer_stacks`, `[L, N/16, K/8, 16]`) counts L."""
    leaves = jax.tree.leaves(worker.runner.state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    packed = sum(
        (v[...].shape[0] if v[...].ndim == 4 else 1)
        for v in leaves
        if isinstance(v, PackedKernel) and is_packed_int4(v[...])
    )
    held = [np.asarray(v[...]) for v in leaves if v[...].dtype == int4.held_dtype()]
    return packed + sum(int(a.min()) >= -8 and int(a.max()) <= 7 for a in held)


def _generate(path: str, prompts, **engine: object) -> tuple[list[list[int]], int]:
    """Greedy tokens of an engine (its method from config.json; `engine`: options over `_ENGINE`),
    and how many 4-bit kernels it holds."""
    llm = LLM(model=path, **(_ENGINE | engine))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        kernels = llm.collective_rpc(_int4_kernels)[0]
    finally:
        del llm
        gc.collect()
    return [list(o.outputs[0].token_ids) for o in out], kernels


def test_w4a16_generates_what_the_decompressed_model_does(checkpoint, prompts, root):
    reference = _transformers(write_decompressed(checkpoint, str(root / "reference")))
    generated, kernels = _generate(checkpoint, prompts)  # compressed-tensors
    assert kernels == 2 * 4  # qkv, o, gate_up, down of each layer; the head stays bfloat16
    _assert_greedy_of(reference, prompts, generated)


def test_gptq_generates_what_the_dequantized_model_does(source, prompts, root):
    path, dequantized = write_gptq(source, str(root / "gptq"), group_size=128)
    reference = _transformers(write_float(source, str(root / "gptq_reference"), dequantized))
    generated, kernels = _generate(path, prompts)  # gptq
    assert kernels == 2 * 4
    _assert_greedy_of(reference, prompts, generated)


@pytest.mark.full  # the model tests check these offsets' logits; here vLLM's acceptance of the config
def test_w4a16_with_zero_points_generates_what_the_decompressed_model_does(source, prompts, root):
    path = write_compressed_w4a16(source, str(root / "w4a16_asym"), group_size=128, symmetric=False)
    reference = _transformers(write_decompressed(path, str(root / "asym_reference")))
    generated, kernels = _generate(path, prompts)
    assert kernels == 2 * 4
    _assert_greedy_of(reference, prompts, generated)


def test_gptq_act_order_generates_what_the_dequantized_model_does(source, prompts, root):
    """desc_act true, groups of 32 in a random order of each projection's inputs: the layers
    gather their inputs into their kernels' group order (`models.gptq_checkpoint`)."""
    path, dequantized = write_gptq(source, str(root / "gptq_act_order"), group_size=32, act_order=5)
    reference = _transformers(write_float(source, str(root / "gptq_act_order_reference"), dequantized))
    generated, kernels = _generate(path, prompts)
    assert kernels == 2 * 4
    _assert_greedy_of(reference, prompts, generated)


def test_awq_generates_what_the_dequantized_model_does(source, prompts, root):
    """vLLM's own GPTQ config refuses `sym: false` at start (its 4-bit types have no zero
    points), so zero points come through `vllm.LLM` from AWQ checkpoints."""
    path, dequantized = write_awq(source, str(root / "awq"), group_size=128)
    reference = _transformers(write_float(source, str(root / "awq_reference"), dequantized))
    generated, kernels = _generate(path, prompts)  # awq, its method from config.json
    assert kernels == 2 * 4
    _assert_greedy_of(reference, prompts, generated)


def test_awq_moe_generates_what_the_dequantized_model_does(root):
    """The experts' values, group scales and offsets stacked (`models.moe`), routed on XLA's dots.
    Trained on the fixed text: a random tiny MoE's near-tied choices, and its routing's, flip on
    bfloat16's roundings (vLLM's AWQ refuses float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    source = save_trained_tiny("Qwen3MoeForCausalLM", str(root / "moe_float"))
    path, dequantized = write_awq(source, str(root / "awq_moe"), group_size=16)
    reference = write_float(source, str(root / "awq_moe_reference"), dequantized)
    ids = text_ids(source)
    moe_prompts = [ids[:12], ids[40:61], ids[100:107]]
    generated, kernels = _generate(path, moe_prompts)
    assert kernels == 3 * 2 + 2 + 2 * 3, kernels  # qkv, o of 3 layers; a dense MLP's 2; 2 layers' 3 stacks
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    _assert_greedy_of(hf, moe_prompts, generated)


@pytest.mark.full  # the routed experts' offsets on a mesh: test_moe_on_mesh in make test
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_with_zero_points_on_two_devices_equals_one(root, tmp_path, expert_parallel):
    """The experts' offsets (compressed-tensors symmetric false, groups of 16) split like their
    scales: inside each expert (gate/up on F, down on its two groups: one a device), or whole
    experts a device under expert parallelism. In float32 (which vLLM's AWQ refuses): a random
    tiny model's near-ties would flip on bfloat16's different sum orders."""
    source = save_tiny("Qwen3MoeForCausalLM", str(root / f"moe_tp_float_{expert_parallel}"))
    path, _ = write_packed_w4a16(
        source, str(root / f"moe_tp_{expert_parallel}"), group_size=16, symmetric=False
    )
    moe_prompts = [list(p) for p in random_prompts([12, 21], seed=3)]
    two = _two_devices_equal_one(
        path, moe_prompts, tmp_path, dtype="float32", enable_expert_parallel=expert_parallel
    )
    offset = two["params"]["model.layers.0.mlp.experts.down_proj.kernel_offset"]
    assert offset["shape"] == [8, 2, 64]
    assert offset["device_bytes"] == [8 * 64 * 4] * 2  # a group of each expert, or 4 experts' two


@pytest.mark.full  # the act-order experts' load and logits: test_int4_moe in make test
def test_gptq_act_order_moe_generates_what_the_dequantized_model_does(root):
    """Every expert's gate/up and down groups in its own order (`models.gptq_expert_orders`). In
    float32: the random tiny model's second prompt has a near-tie (0.02 apart) that bfloat16 flips."""
    import torch
    from transformers import AutoModelForCausalLM

    source = save_tiny("Qwen3MoeForCausalLM", str(root / "act_order_moe_float"))
    path, dequantized = write_gptq(source, str(root / "act_order_moe"), group_size=16, act_order=3)
    reference = write_float(source, str(root / "act_order_moe_reference"), dequantized)
    moe_prompts = [list(p) for p in random_prompts([12, 21, 7], seed=3)]
    generated, kernels = _generate(path, moe_prompts, dtype="float32")
    assert kernels == 3 * 2 + 2 + 2 * 3, kernels  # qkv, o of 3 layers; a dense MLP's 2; 2 layers' 3 stacks
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    _assert_greedy_of(hf, moe_prompts, generated)


@pytest.mark.full  # the gather on a mesh: test_moe_on_mesh; the load: test_int4_moe
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_gptq_act_order_moe_on_two_devices_equals_one(root, tmp_path, expert_parallel):
    """Inside each expert: gate/up's columns (put in down's row order at load) and down's rows
    split at the same place, on down's two groups of 16, each expert's gate/up order whole on
    each device; by index: each device its 4 experts' orders. In float32, as the zero-point
    test above."""
    source = save_tiny("Qwen3MoeForCausalLM", str(root / f"act_order_moe_tp_float_{expert_parallel}"))
    out = str(root / f"act_order_moe_tp_{expert_parallel}")
    path, _ = write_gptq(source, out, group_size=16, act_order=3)
    moe_prompts = [list(p) for p in random_prompts([12, 21], seed=3)]
    two = _two_devices_equal_one(
        path, moe_prompts, tmp_path, dtype="float32", enable_expert_parallel=expert_parallel
    )
    order = two["params"]["model.layers.0.mlp.experts.gate_proj.input_order"]
    assert order["shape"] == [8, 64]
    assert order["device_bytes"] == [(4 if expert_parallel else 8) * 64 * 4] * 2


@pytest.mark.full  # the W4A16 test below splits the same packed groups and scales in make test
def test_awq_on_two_devices_equals_one(source, prompts, root, tmp_path):
    """The offsets split like the scales: column-parallel ones on their outputs, o_proj's and
    down_proj's on their groups (one whole 128-input group on each of 2 devices)."""
    path, _ = write_awq(source, str(root / "awq_tp"), group_size=128)
    two = _two_devices_equal_one(path, prompts, tmp_path)
    offset = two["params"]["model.layers.0.mlp.down_proj.kernel_offset"]
    assert offset["shape"] == [2, 128] and offset["device_bytes"] == [128 * 4] * 2  # a group each


@pytest.mark.full  # the W4A16 test below splits packed groups in make test
def test_gptq_act_order_on_two_devices_equals_one(source, prompts, root, tmp_path):
    """down_proj's rows (in group order) split on whole groups of 32, its input order whole on
    each device: the gathered inputs reach the device whose rows read them."""
    path, _ = write_gptq(source, str(root / "gptq_act_order_tp"), group_size=32, act_order=5)
    two = _two_devices_equal_one(path, prompts, tmp_path)
    order = two["params"]["model.layers.0.mlp.down_proj.input_order"]
    assert order["shape"] == [256] and order["device_bytes"] == [256 * 4] * 2  # whole on each


def _two_devices_equal_one(path: str, prompts, tmp_path, dtype: str | None = None, **two: object) -> dict:
    llm = dict(_ENGINE, max_num_batched_tokens=16) | ({"dtype": dtype} if dtype else {})
    runs = [
        {"tp": tp, "prompts": prompts[:2], "new_tokens": 6, "llm": llm | (two if tp == 2 else {})}
        for tp in (1, 2)
    ]
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": path, "runs": runs}))
    env = {**environment(), "VLLM_XLA_ATTENTION_BACKEND": "xla"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.plugin_shim.tensor_parallel_engine", str(job), str(out)],
        env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    one, two = json.loads(out.read_text())
    assert two["tokens"] == one["tokens"]
    np.testing.assert_allclose(np.array(two["logprobs"]), np.array(one["logprobs"]), atol=1e-2)
    return two


def test_w4a16_on_two_devices_equals_one(checkpoint, prompts, tmp_path):
    """Tensor parallelism over 2 simulated devices (a subprocess: the device count is fixed when
    JAX starts): the int4 kernels and their group scales split with their columns (o_proj's and
    down_proj's by rows: one whole 128-input group on each device); same tokens and logprobs."""
    two = _two_devices_equal_one(checkpoint, prompts, tmp_path)
    down = two["params"]["model.layers.0.mlp.down_proj.kernel"]
    assert down["shape"] == [256, 128] and down["device_bytes"] == [down["bytes"] // 2] * 2  # half each
    scale = two["params"]["model.layers.0.mlp.down_proj.kernel_scale"]
    assert scale["shape"] == [2, 128] and scale["device_bytes"] == [128 * 4] * 2  # a group each
