# SPDX-License-Identifier: Apache-2.0
"""Test environment: CPU JAX, in-process vLLM engine, no hub, a persistent compilation cache."""

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_XLA_PLATFORM", "cpu")
os.environ.setdefault("VLLM_XLA_CACHE_DIR", str(_REPO / ".cache" / "vllm-xla"))
os.environ.setdefault("VLLM_XLA_CPU_KV_CACHE_GB", "0.25")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
