# SPDX-License-Identifier: Apache-2.0
"""`vllm-xla generate`: a one-shot run with the engine in the same process."""

import os
import subprocess
import sys

from pallas_kernels import cpu
from tests.tiny_models import save_tiny_llama

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generate_prints_the_completion_in_one_process(tmp_path, native_kernels):
    model_dir = save_tiny_llama(str(tmp_path / "model"), seed=2)
    env = {
        k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"
    }  # the CLI's own default
    cli = os.path.join(os.path.dirname(sys.executable), "vllm-xla")
    done = subprocess.run(
        [cli, "generate", "hello world", "--model", model_dir, "--max-tokens", "4", "--max-model-len", "128",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "16"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("hello world")
    logs = done.stdout + done.stderr
    assert "warm-up built" in logs
    assert "(EngineCore" not in logs  # no engine-core subprocess was started
    # dtype auto: bfloat16 on the native dense kernel where the CPU has it, else float32.
    dtype = "bfloat16" if cpu.dense_isa(native_kernels) else "float32"
    assert f"loaded LlamaForCausalLM ({dtype})" in logs
