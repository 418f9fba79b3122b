# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla convert` refuses an fp8 checkpoint by name (a converted directory keeps int8 or
float weights; the fp8 checkpoint serves as it is) before reading any weight."""

import argparse

import pytest

from plugin_shim.cli import cmd_convert
from tests.models.fp8_checkpoints import write_block_fp8
from tests.tiny_models import save_tiny_llama


def test_convert_refuses_an_fp8_source_by_name(tmp_path):
    source = save_tiny_llama(str(tmp_path / "float"), hidden_size=128, intermediate_size=256)
    fp8 = write_block_fp8(source, str(tmp_path / "fp8"))
    args = argparse.Namespace(
        model=fp8, out=str(tmp_path / "out"), dtype="bfloat16", packing="none", quantization="none"
    )
    with pytest.raises(SystemExit, match="the source holds fp8 weights"):
        cmd_convert(args)
    assert not (tmp_path / "out").exists()
