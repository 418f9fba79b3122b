# SPDX-License-Identifier: Apache-2.0
"""vLLM counts a latent (MLA) cache's blocks from the worker's spec; the runner then allocates that
many pages in the attention backend's layout. The spec's page must be the allocated page, for every
backend's layout: the TPU kernel stores a 576-value row in 640 lanes, and a spec of 576 values
would have vLLM count more blocks than the memory it was given holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

from models import ModelConfig
from plugin_shim.worker import latent_kv_specs
from tests.models import tiny_deepseek
from tpu_platform.kv_cache import allocate_stacked_caches, page_bytes_per_device
from tpu_platform.planner.plan import model_config

PAGE = 16
LAYERS = 3
BACKENDS = ("xla", "pallas_tpu", "pallas_gpu", "cpu_native")
# (JAX dtype, the spec's torch dtype, vLLM's cache dtype name)
DTYPES = {
    "bfloat16": (jnp.bfloat16, torch.bfloat16, "auto"),
    "fp8": (jnp.float8_e4m3fn, torch.float8_e4m3fn, "fp8"),
}
V3 = model_config("deepseek-v3")  # rows of 512 + 64 values
_, _, _TINY_OVERRIDES = tiny_deepseek.VARIANTS["v3_noaux_yarn"]
TINY_V3 = ModelConfig.from_hf_dict(  # rows of 32 + 8 values
    {**tiny_deepseek._COMMON, **_TINY_OVERRIDES, "architectures": ["DeepseekV3ForCausalLM"]}
)


def _allocated_bytes(num_pages: int, width: int, dtype: jnp.dtype, backend: str) -> int:
    arrays = jax.eval_shape(
        lambda: allocate_stacked_caches(LAYERS, num_pages, PAGE, 1, 1, dtype, backend, latent_width=width)
    )
    return sum(a.size * a.dtype.itemsize for a in arrays)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", [V3, TINY_V3], ids=["v3", "tiny"])
def test_vllm_counts_the_blocks_the_runner_allocates(backend, dtype_name, config):
    dtype, torch_dtype, cache_dtype = DTYPES[dtype_name]
    width = config.latent_cache_width
    page_bytes = page_bytes_per_device(config, PAGE, 1, dtype, backend)  # the runner's page
    specs = latent_kv_specs(
        LAYERS, page_bytes=page_bytes, block_size=PAGE, head_size=width, dtype=torch_dtype,
        cache_dtype_str=cache_dtype,
    )  # fmt: skip
    assert all(spec.page_size_bytes == page_bytes for spec in specs.values())
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # what the engine resolves for our worker
    available = 1000 * LAYERS * page_bytes + page_bytes // 2
    groups = get_kv_cache_groups(vllm_config, specs)
    num_blocks = get_kv_cache_config_from_groups(vllm_config, groups, available).num_blocks
    allocated = _allocated_bytes(num_blocks, width, dtype, backend)
    assert num_blocks == 1000
    assert allocated == num_blocks * LAYERS * page_bytes <= available


def test_the_tpu_layout_pads_rows_and_the_spec_says_so():
    specs = latent_kv_specs(
        1, page_bytes=page_bytes_per_device(V3, PAGE, 1, jnp.bfloat16, "pallas_tpu"), block_size=PAGE,
        head_size=576, dtype=torch.bfloat16, cache_dtype_str="auto",
    )  # fmt: skip
    (spec,) = specs.values()
    assert spec.real_page_size_bytes == PAGE * 576 * 2  # what the tokens hold
    assert spec.page_size_bytes == PAGE * 640 * 2  # what the page takes
    (unpadded,) = latent_kv_specs(
        1, page_bytes=PAGE * 576 * 2, block_size=PAGE, head_size=576, dtype=torch.bfloat16
    ).values()
    assert unpadded.page_size_padded is None
