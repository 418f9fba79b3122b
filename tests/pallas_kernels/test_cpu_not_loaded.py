# SPDX-License-Identifier: Apache-2.0
"""Every native CPU kernel, called before `load`, fails naming the fix (not a missing custom call)."""

import subprocess
import sys

# A fresh interpreter: the test process has the kernels loaded.
_SCRIPT = """
import inspect
from pallas_kernels import cpu
from pallas_kernels.cpu import activation, dense, dense_int4, dense_int8, rope_kv
entries = [cpu.ragged_paged_attention, activation.silu_and_mul, dense.native_dense,
           dense_int4.native_dense_int4, dense_int8.native_dense_int8, rope_kv.rope_write_kv]
assert not cpu.is_loaded()
for entry in entries:
    params = inspect.signature(entry).parameters.values()
    args = [None for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    kwargs = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    try:
        entry(*args, **kwargs)
    except cpu.NativeKernelError as error:
        print(entry.__name__, "|", error)
    else:
        print(entry.__name__, "| no error")
"""


def test_each_kernel_before_load_names_the_fix():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" | ", 1) for line in done.stdout.splitlines())
    assert len(lines) == 6, done.stdout
    for name, message in lines.items():
        assert "not loaded in this process" in message, name
        assert "pallas_kernels.cpu.load(build_dir)" in message, name
    assert lines["ragged_paged_attention"].endswith("or use the attention backend 'xla'")
    assert lines["rope_write_kv"].endswith("or use the attention backend 'xla'")
