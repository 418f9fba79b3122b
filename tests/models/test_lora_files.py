# SPDX-License-Identifier: Apache-2.0
"""What an adapter's files may not bring into the slots every row shares (`models.lora_files`):
non-finite values or alphas, values the slot dtype cannot hold, and a `target_modules` pattern
that would stall a backtracking regex engine (`models.lora_targets`); and bfloat16 adapters,
PEFT's usual dtype, read as the float32 values they hold."""

import json
import os
import re
import threading

import ml_dtypes
import numpy as np
import pytest

from models.lora import LoraSite
from models.lora_files import read_adapter
from models.lora_targets import PatternError, compile_target_pattern

Q = "model.layers.0.self_attn.q_proj"
SITES = {Q: LoraSite((Q,), (8,), 8)}


def _write(path, a, b, config_text=None, **config):
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file(
        {f"base_model.model.{Q}.lora_A.weight": a, f"base_model.model.{Q}.lora_B.weight": b},
        os.path.join(path, "adapter_model.safetensors"),
    )
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(config_text or json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))
    return path


def _ones(dtype=np.float32):
    return np.ones((2, 8), dtype), np.ones((8, 2), dtype)


def _with(array, index, value):
    array = array.copy()
    array[index] = value
    return array


@pytest.mark.parametrize(
    "a, b, config_text, slot_dtype, named",
    [
        (_with(_ones()[0], (0, 3), np.nan), _ones()[1], None, np.float32, "lora_A holds NaN or infinite"),
        (_ones()[0], _with(_ones()[1], (5, 1), np.inf), None, np.float32, "lora_B holds NaN or infinite"),
        (_ones()[0], _with(_ones()[1], (5, 1), 3e38), None, np.float32, "lora_B holds NaN or infinite"),
        (_ones()[0], _with(_ones()[1], (0, 0), 4e4), None, np.float16, "beyond the float16 LoRA slots"),
        (*_ones(), '{"peft_type": "LORA", "r": 2, "lora_alpha": NaN}', np.float32, "lora_alpha=nan"),
        (*_ones(), '{"peft_type": "LORA", "r": 2, "lora_alpha": -Infinity}', np.float32, "lora_alpha=-inf"),
        (*_ones(), '{"peft_type": "LORA", "r": 2, "lora_alpha": "16"}', np.float32, "lora_alpha='16'"),
        (*_ones(), '{"peft_type": "LORA", "r": 0}', np.float32, "r=0.0 is not a positive integer"),
    ],
)
def test_values_no_slot_can_hold_are_refused_naming_the_adapter(
    tmp_path, a, b, config_text, slot_dtype, named
):
    path = _write(str(tmp_path), a, b, config_text)
    with pytest.raises(ValueError, match=re.escape(named)) as raised:
        read_adapter("poison", path, SITES, 4, slot_dtype)
    assert "'poison'" in str(raised.value)


def test_values_within_the_slot_dtype_are_read(tmp_path):
    a, b = _ones()
    adapter = read_adapter("ok", _write(str(tmp_path), a, _with(b, (0, 0), 1e4)), SITES, 4, np.float16)
    assert adapter.slot_values[Q][1].max() == 2e4  # B scaled by alpha / r


def test_a_bfloat16_adapter_reads_as_its_float32_values(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 8)).astype(ml_dtypes.bfloat16)
    b = rng.normal(size=(8, 2)).astype(ml_dtypes.bfloat16)
    adapter = read_adapter("bf16", _write(str(tmp_path), a, b), SITES, 4, ml_dtypes.bfloat16)
    slot_a, slot_b = adapter.slot_values[Q]
    np.testing.assert_array_equal(slot_a[:, :2], a.T.astype(np.float32))
    np.testing.assert_array_equal(slot_b[:2], b.T.astype(np.float32) * 2)


MODULES = [
    f"model.layers.{i}.{group}.{name}"
    for i in (0, 1, 12)
    for group, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("up_proj",)))
    for name in names
]


@pytest.mark.parametrize(
    "pattern",
    [
        r".*\.(q_proj|v_proj)",
        r"model\.layers\.[01]\..*proj",
        r"^.*layers\.\d+\.mlp\..*$",
        r"model.layers.(0|12).self_attn.[qk]_proj",
        r".*[^q]_proj",
        r"(?:.*\.)?up_proj",
        r".*\.\w{1,4}_proj",
        r"model\.layers\.1\d?\.self_attn\.o_proj",
        r".{5,}q_proj|x",
    ],
)
def test_a_target_pattern_matches_module_paths_as_python_re_fullmatch_does(pattern):
    compiled = compile_target_pattern(pattern)
    assert [compiled.fullmatch(m) for m in MODULES] == [re.fullmatch(pattern, m) is not None for m in MODULES]


def _in_a_thread(function, seconds=60.0):
    """`function()`'s result, or a failure when it has not returned within `seconds` (generous:
    a backtracking engine takes years on these inputs, the linear matcher milliseconds)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the matcher did not return"
    return result[0]


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a|aa)*b", r"(.*)*x", ".*" * 30 + "x"])
def test_a_catastrophic_pattern_returns_promptly(pattern):
    text = "a" * 5000 + "!"
    compiled = compile_target_pattern(pattern)
    assert _in_a_thread(lambda: compiled.fullmatch(text)) is False


def test_an_adapter_with_a_catastrophic_pattern_is_read_promptly(tmp_path):
    """A string target_modules runs over every module path of the model: `(.+)+q_proj!` takes a
    backtracking engine time exponential in a path's length (hours for these)."""
    long_path = Q.replace("layers", "layers" * 8)
    sites = {m: LoraSite((m,), (8,), 8) for m in (Q, long_path)}
    path = _write(str(tmp_path), *_ones(), target_modules=r"(.+)+q_proj!")
    adapter = _in_a_thread(lambda: read_adapter("slow", path, sites, 4))
    assert adapter.targets == ("q_proj",)


@pytest.mark.parametrize(
    "pattern, named",
    [
        (r"(a)\1", "escape \\1 is not supported"),
        (r"(?=q).*", "'(?' groups"),
        (r"(?i)Q_PROJ", "'(?' groups"),
        (r"a*+", "a quantifier after a quantifier"),
        ("x" * 2000, "2000 characters long; at most 1024"),
        (r"((a{0,100}){0,100}){0,100}", "more than 20000 states"),
        (r"[q", "missing ']'"),
    ],
)
def test_a_pattern_the_matcher_does_not_run_is_refused_by_name(tmp_path, pattern, named):
    with pytest.raises(PatternError, match=re.escape(named)):
        compile_target_pattern(pattern)
    path = _write(str(tmp_path), *_ones(), target_modules=pattern)
    with pytest.raises(ValueError, match=re.escape(named)) as raised:
        read_adapter("regex", path, SITES, 4)
    assert "'regex'" in str(raised.value)
