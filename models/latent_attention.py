# SPDX-License-Identifier: Apache-2.0
"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged latent cache.

Each token's keys and values are compressed to one latent `c_kv [L]` (`kv_a_proj_with_mqa`, then
`kv_a_layernorm`) beside one decoupled RoPE key `k_rope [R]` shared by every head; the cache
holds only `[c_kv | k_rope]` (`pallas_kernels.mla`). Heads never see up-projected keys or
values: each head's key up-projection `W_UK` is absorbed into its query and its value
up-projection `W_UV` applied to the attention-weighted latent (exact, `pallas_kernels.
mla_reference`), so every step, prefill or decode, reads only the latent cache.

Queries come from `q_proj` (V2-Lite) or the low-rank `q_a_proj -> q_a_layernorm -> q_b_proj`
(`q_lora_rank`, V3). RoPE rotates the last R dimensions of each query head and the shared key, as
interleaved pairs (V2; V3's `rope_interleave`) or halves; YaRN scaling multiplies the cosines and
sines by its attention factor and the softmax scale by DeepSeek's `mscale` correction.

Tensor parallelism: the query projection, `kv_b_proj` and the output projection are split on
heads (each device its own heads' `W_UK`, `W_UV`); the latent projection and the latent cache are
replicated, since the one shared row a token has no head axis to split (`pallas_kernels.mla`).
Axis letters: T tokens, N heads, L latent, R rope width, Dn / Dv per-head key / value widths.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from models.deepseek_config import DeepseekConfig
from models.int8 import dequantize
from models.layers import RMSNorm
from models.linear import Linear, zeros_param
from models.metadata import AttentionMetadata
from models.rope import apply_rope, rope_cos_sin, rope_inverse_frequencies
from models.sharding import MODEL_AXIS
from pallas_kernels import latent_cache_partition_spec, mla_paged_attention, write_latent

# The low-rank projections' norms use DeepSeek's fixed epsilon, not `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(nnx.Module):
    """`kv_b_proj`: per head, `W_UK [L, Dn]` then `W_UV [L, Dv]`, stored `[L, N * (Dn + Dv)]`
    (a Linear's layout, so its columns split on heads). Only ever used folded into the query
    and after attention, never as a matmul on cached values.

    A quantized checkpoint's (DeepSeek-V3/R1 as released: 128x128-block fp8) keeps its values and
    `kernel_scale` (`[L / G, out]`, as a Linear's) on the device; `weights` widens them where the
    step uses them."""

    def __init__(self, latent: int, heads: int, nope: int, value: int, *, dtype: jnp.dtype):
        self.kernel = zeros_param((latent, heads * (nope + value)), dtype)
        self.kernel_scale: nnx.Param | None = nnx.data(None)

    def weights(self, dtype: jnp.dtype) -> jax.Array:
        """The up-projections `[L, N * (Dn + Dv)]` in `dtype` (dequantized when scaled)."""
        if self.kernel_scale is None:
            return self.kernel[...]
        return dequantize(self.kernel[...], self.kernel_scale[...], dtype)


class LatentAttention(nnx.Module):
    """MLA self-attention over the paged latent cache (module docstring)."""

    def __init__(self, config: DeepseekConfig, *, dtype: jnp.dtype):
        d, n, latent = config.hidden_size, config.num_heads, config.kv_lora_rank
        nope, rope, value = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        bias = config.attention_bias
        if config.q_lora_rank:
            self.q_a_proj = Linear(d, config.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(config.q_lora_rank, n * (nope + rope), bias=False, dtype=dtype)
        else:
            self.q_proj = Linear(d, n * (nope + rope), bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(d, latent + rope, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(latent, eps=LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = LatentUpProjection(latent, n, nope, value, dtype=dtype)
        self.o_proj = Linear(n * value, d, bias=bias, dtype=dtype)
        self.low_rank_q = bool(config.q_lora_rank)
        self.num_heads, self.latent, self.nope, self.rope, self.value = n, latent, nope, rope, value
        self.interleaved = config.rope_interleave
        yarn = config.yarn
        self.theta, self.yarn = config.rope_theta, yarn
        self.rope_scale = 1.0 if yarn is None else yarn.rope_scale
        self.sm_scale = (nope + rope) ** -0.5 * (1.0 if yarn is None else yarn.softmax_scale)

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array, md: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        t, n = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        kv = self.kv_a_proj_with_mqa(x)  # [T, L + R]
        latent = self.kv_a_layernorm(kv[:, : self.latent])  # [T, L]
        cos, sin = rope_cos_sin(positions, self._inverse_frequencies())  # [T, R / 2]
        cos, sin = cos * self.rope_scale, sin * self.rope_scale
        k_rope = self._rotate(kv[:, None, self.latent :], cos, sin)[:, 0]  # [T, R]
        q = q.reshape(t, n, self.nope + self.rope)
        q = jnp.concatenate([q[..., : self.nope], self._rotate(q[..., self.nope :], cos, sin)], axis=-1)
        q = q.reshape(t, n * (self.nope + self.rope))
        w_kv = self.kv_b_proj.weights(x.dtype)
        if md.mesh is None:
            o, kv_cache = self._attend(q, latent, k_rope, w_kv, kv_cache, md)
        else:  # each device: its own heads' queries and up-projections, the whole latent cache
            heads, whole, cache = (
                PartitionSpec(None, MODEL_AXIS),
                PartitionSpec(),
                latent_cache_partition_spec(),
            )
            o, kv_cache = jax.shard_map(
                self._attend,
                mesh=md.mesh,
                in_specs=(heads, whole, whole, heads, cache, whole),
                out_specs=(heads, cache),
                check_vma=False,
            )(q, latent, k_rope, w_kv, kv_cache, dataclasses.replace(md, mesh=None))
        return self.o_proj(o), kv_cache  # [T, D]

    def _inverse_frequencies(self) -> np.ndarray:
        if self.yarn is None:
            return rope_inverse_frequencies(self.rope, self.theta, None)
        return self.yarn.inverse_frequencies(self.rope, self.theta)

    def _rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """RoPE on `x[T, heads, R]`: interleaved pairs are gathered into halves first (the same
        dot products as rotating them in place, since queries and keys move alike)."""
        if self.interleaved:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rope(x, cos, sin)

    def _attend(
        self,
        q: jax.Array,
        latent: jax.Array,
        k_rope: jax.Array,
        w_kv: jax.Array,
        kv_cache: jax.Array,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:
        """The latent write, and attention of `q`'s heads (all, or one device's) with `W_UK`
        absorbed and `W_UV` applied after: `[T, n * Dv]` and the cache."""
        t, dtype = q.shape[0], latent.dtype
        n = w_kv.shape[1] // (self.nope + self.value)
        q = q.reshape(t, n, self.nope + self.rope)
        w_kv = w_kv.reshape(self.latent, n, self.nope + self.value)
        w_uk, w_uv = w_kv[..., : self.nope], w_kv[..., self.nope :]  # [L, n, Dn], [L, n, Dv]
        f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
        q_latent = f32("tnd,lnd->tnl", q[..., : self.nope], w_uk).astype(dtype)  # [T, n, L]
        cache_args = dict(backend=md.backend, kv_dtype=md.kv_dtype, first_page=md.first_page)
        kv_cache = write_latent(kv_cache, latent, k_rope, md.slot_mapping, **cache_args)
        o = mla_paged_attention(
            jnp.concatenate([q_latent, q[..., self.nope :].astype(dtype)], axis=-1), kv_cache,
            md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=self.sm_scale, latent_dim=self.latent, **cache_args,
        )  # fmt: skip
        o = f32("tnl,lnv->tnv", o, w_uv).astype(dtype)  # [T, n, Dv]
        return o.reshape(t, n * self.value), kv_cache
