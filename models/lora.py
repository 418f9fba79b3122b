# SPDX-License-Identifier: Apache-2.0
"""LoRA adapters on the dense projections: slots of stacked low-rank weights in the model, and
the batched update every projection adds for its tokens' adapters.

Each projection that can carry an adapter (a "site": the fused `qkv_proj`, `o_proj`, the fused
`gate_up_proj`, `down_proj` of every layer) holds `a [S, in, P * R]` and `b [S, P * R, out]`, for
`S = max_loras + 1` slots (slot 0: no adapter, zeros), `P` the parts fused into it (3 for q/k/v,
2 for gate/up, else 1) and `R = max_lora_rank`. Part p's `A` fills ranks `[p * R, p * R + r)`
and its `B` the same rows of `b`, in part p's own columns: `b` is block diagonal, so
`(x @ a) @ b` gives each part its own update in the fused output's columns (interleaved in
blocks as the fused kernel is, `Linear.concatenated`). Smaller ranks are zero-padded and the
scaling (`lora_alpha / r`) is folded into `b`, so loading an adapter only writes one slot of
arrays whose shapes never change: the step is never compiled again.

Which slot each token uses comes with the step (`set_lora_tokens`, inside the jitted step): the
tokens with an adapter are grouped by slot in tiles (`LoraTokens`), each tile multiplied by its
own slot's `a` and `b` only, so a token costs its own adapter's rank, whatever the other slots
hold; a step without adapters does no adapter math at all.
Adapter files (PEFT: `adapter_config.json` + `adapter_model.safetensors`) are read with NumPy
(`models.lora_files`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import GatedMLP, PagedAttention
from models.linear import Linear
from models.moe import num_tiles, tile_rows
from models.sharding import interleave_blocks, repeat_kv_heads

# The HF module names an adapter may target, by where they live in a decoder layer.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


class LoraA(nnx.Variable):
    """`[S, in, P * R]`: every slot's A matrices, the parts' side by side along the rank."""


class LoraB(nnx.Variable):
    """`[S, P * R, out]`: every slot's (scaled) B matrices, block diagonal over the parts."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraTokens:
    """A step's tokens grouped by adapter slot, for every projection's update (`lora_tokens`).

    The tokens with an adapter are sorted by slot and each slot's tokens padded to a multiple
    of `rows` (B), so every B-row tile holds one slot's tokens: a tile is multiplied by its own
    slot's weights only, and tokens without an adapter are in no tile."""

    any_adapter: jax.Array  # [] bool: some token has an adapter (else no adapter math at all)
    has_adapter: jax.Array  # [T] bool
    tile_tokens: jax.Array  # [N * B] int32: the token in each tiled row; T for an empty row
    tile_slots: jax.Array  # [N] int32: the slot of each tile's tokens
    token_rows: jax.Array  # [T] int32: each token's row in the tiled layout (0 without an adapter)
    rows: int = dataclasses.field(metadata=dict(static=True))  # B


def lora_tokens(slots: jax.Array, num_slots: int) -> LoraTokens:
    """The tiling of a step's `[T]` slots (0: no adapter) over adapter slots 1..num_slots - 1.

    The tile count is static (`moe.num_tiles`: each slot in use wastes under one tile), the rows
    per tile about half the mean tokens per slot (`moe.tile_rows`): a decode step of a few
    tokens per adapter multiplies few rows, a prefill step wide tiles."""
    t = slots.shape[0]
    groups = num_slots - 1
    rows = tile_rows(t, groups)
    n = num_tiles(t, groups, rows)
    has_adapter = slots > 0
    counts = jnp.bincount(slots, length=num_slots)  # [S] tokens per slot
    padded = (counts.at[0].set(0) + rows - 1) // rows * rows  # [S] tiled rows; none for slot 0
    padded_end = jnp.cumsum(padded)  # [S] where each slot's tiles end
    group_start = jnp.cumsum(counts) - counts  # [S] each slot's first sorted position
    order = jnp.argsort(slots, stable=True).astype(jnp.int32)  # [T] token at each sorted position
    sorted_slots = slots[order]  # [T]
    rank = jnp.arange(t, dtype=jnp.int32) - group_start[sorted_slots]  # [T] position in its slot
    dest = padded_end[sorted_slots] - padded[sorted_slots] + rank  # [T] row in the tiled layout
    dest = jnp.where(sorted_slots > 0, dest, n * rows).astype(jnp.int32)  # no adapter: no row
    tile_tokens = jnp.full((n * rows,), t, jnp.int32).at[dest].set(order, mode="drop")
    tile_slots = jnp.searchsorted(padded_end, jnp.arange(n) * rows, side="right")  # [N]
    tile_slots = jnp.minimum(tile_slots, groups).astype(jnp.int32)  # past the last: empty rows
    token_rows = jnp.zeros(t, jnp.int32).at[order].set(jnp.where(sorted_slots > 0, dest, 0))
    return LoraTokens(jnp.any(has_adapter), has_adapter, tile_tokens, tile_slots, token_rows, rows)


class LoraWeights(nnx.Module):
    """One projection's adapter slots, and (inside a step) its tokens grouped by slot."""

    def __init__(self, a: np.ndarray, b: np.ndarray):
        self.a = LoraA(a)
        self.b = LoraB(b)
        self.tokens: LoraTokens | None = nnx.data(None)  # `set_lora_tokens`

    def add_update(self, y: jax.Array, x: jax.Array) -> jax.Array:
        """`y [T, out]` (float32) plus each token's own `(x @ A[slot]) @ B[slot]`; a step without
        adapters skips the update, and a token without an adapter gets nothing from any slot.

        Tokens are multiplied in tiles of one slot each (`LoraTokens`): a token is computed
        with its own adapter only, and a non-finite slot cannot reach another slot's tokens
        or tokens without an adapter (selected out, never multiplied by zero)."""
        tokens = self.tokens
        if tokens is None:
            raise ValueError("LoRA weights used outside a step: call set_lora_tokens first")
        a, b = self.a[...], self.b[...]
        return jax.lax.cond(tokens.any_adapter, lambda: y + tiled_update(x, a, b, tokens), lambda: y)


def tiled_update(x: jax.Array, a: jax.Array, b: jax.Array, tokens: LoraTokens) -> jax.Array:
    """Each token's `(x @ A[slot]) @ B[slot]`, float32 `[T, out]` (zeros without an adapter).

    Each tile takes its slot's weights: the temporaries are one slot's copy per tile (N of them,
    at most T / B plus the slots in use) and the `[T, out]` products, never a copy per token.

    Args:
      x: `[T, in]`; a: `[S, in, P * R]`; b: `[S, P * R, out]`; tokens: `lora_tokens(slots, S)`.
    """
    n, rows = tokens.tile_slots.shape[0], tokens.rows
    x_rows = jnp.take(x.astype(a.dtype), tokens.tile_tokens, axis=0, mode="fill", fill_value=0)
    x_rows = x_rows.reshape(n, rows, x.shape[1])  # [N, B, in]
    a_tiles, b_tiles = a[tokens.tile_slots], b[tokens.tile_slots]  # [N, in, P * R], [N, P * R, out]
    xa = jnp.einsum("nbi,nir->nbr", x_rows, a_tiles, preferred_element_type=jnp.float32)
    update = jnp.einsum("nbr,nro->nbo", xa.astype(b.dtype), b_tiles, preferred_element_type=jnp.float32)
    update = update.reshape(n * rows, b.shape[2])[tokens.token_rows]  # [T, out]
    return jnp.where(tokens.has_adapter[:, None], update, jnp.zeros((), update.dtype))


def set_lora_tokens(model: nnx.Module, slots: jax.Array) -> None:
    """Gives every projection with adapter slots this step's `[T]` slot of each token, grouped
    (`lora_tokens`; traced: call it on the step's own merged model, inside the jitted step)."""
    grouped: dict[int, LoraTokens] = {}
    for _, module in nnx.iter_modules(model):
        if isinstance(module, LoraWeights):
            count = module.a.shape[0]
            if count not in grouped:
                grouped[count] = lora_tokens(slots, count)
            module.tokens = grouped[count]


@dataclasses.dataclass(frozen=True)
class LoraSite:
    """A projection that carries adapters: the HF module names of its parts (fused in this order),
    each part's output width, the blocks its columns are interleaved in, and how many times
    each part's heads of `head_dim` columns are repeated (k and v on a mesh of more devices than
    KV heads, `sharding.kv_heads_on_mesh`; an adapter's B is repeated alike)."""

    parts: tuple[str, ...]  # full HF module paths, e.g. "model.layers.0.self_attn.q_proj"
    widths: tuple[int, ...]
    in_features: int
    blocks: int = 1
    head_repeats: tuple[int, ...] = ()  # per part; () for none
    head_dim: int = 0

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    def adapter_width(self, part: int) -> int:
        """Part `part`'s output width in the checkpoint (and its adapters): before repetition."""
        return self.widths[part] // (self.head_repeats[part] if self.head_repeats else 1)


def lora_sites(model: nnx.Module) -> dict[str, LoraSite]:
    """Every projection of `model` (after `fuse_projections`) that can carry an adapter, by the
    path of its Linear (e.g. "model.layers.0.self_attn.qkv_proj")."""
    refused = getattr(type(model), "lora_refused", None)  # a model whose projections take none
    if refused:
        raise ValueError(refused)
    sites: dict[str, LoraSite] = {}
    config = getattr(model, "config", None)
    for path, module in nnx.iter_modules(model):
        prefix = ".".join(map(str, path))
        if isinstance(module, PagedAttention):
            qkv = ("q_proj", "k_proj", "v_proj")
            if module.qkv_proj is None:
                for name in qkv:
                    sites[f"{prefix}.{name}"] = _single(prefix, name, getattr(module, name))
            else:
                n, k, h = module.num_heads, module.num_kv_heads, module.head_dim
                repeats = k // config.num_kv_heads if config is not None else 1
                sites[f"{prefix}.qkv_proj"] = LoraSite(
                    tuple(f"{prefix}.{name}" for name in qkv), (n * h, k * h, k * h),
                    module.qkv_proj.in_features, head_repeats=(1, repeats, repeats), head_dim=h,
                )  # fmt: skip
            sites[f"{prefix}.o_proj"] = _single(prefix, "o_proj", module.o_proj)
        elif isinstance(module, GatedMLP):
            if module.gate_up_proj is None:
                for name in ("gate_proj", "up_proj"):
                    sites[f"{prefix}.{name}"] = _single(prefix, name, getattr(module, name))
            else:
                fused = module.gate_up_proj
                width = fused.out_features // 2
                sites[f"{prefix}.gate_up_proj"] = LoraSite(
                    (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
                    (width, width),
                    fused.in_features,
                    module.blocks,
                )
            sites[f"{prefix}.down_proj"] = _single(prefix, "down_proj", module.down_proj)
    return sites


def _single(prefix: str, name: str, linear: Linear) -> LoraSite:
    return LoraSite((f"{prefix}.{name}",), (linear.out_features,), linear.in_features)


def attach_lora(
    model: nnx.Module, *, max_loras: int, max_rank: int, dtype: jnp.dtype, blocks: int = 1
) -> dict[str, LoraSite]:
    """Gives every adapter site of `model` zeroed slots for `max_loras` adapters of rank up to
    `max_rank` (host arrays, placed with the rest of the state); returns the sites.
    `blocks`: the tensor-parallel size the fused projections were interleaved for."""
    sites = lora_sites(model)
    slots = max_loras + 1
    for key, site in sites.items():
        if len(site.parts) > 1:
            site = dataclasses.replace(site, blocks=blocks)
            sites[key] = site
        rank = len(site.parts) * max_rank
        linear = _module_at(model, key)
        a = np.zeros((slots, site.in_features, rank), dtype)
        b = np.zeros((slots, rank, site.out_features), dtype)
        linear.lora = LoraWeights(a, b)
    return sites


def _module_at(model: nnx.Module, key: str) -> Linear:
    module = model
    for part in key.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def site_slot_values(
    site: LoraSite, parts: dict[str, tuple[np.ndarray, np.ndarray]], max_rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """One slot's `a [in, P * R]` and `b [P * R, out]` of `site` from its parts' adapter weights
    (`{hf_module: (A [in, r], B [r, adapter width] scaled)}`, float32; a missing part stays zero)."""
    rank = len(site.parts) * max_rank
    a = np.zeros((site.in_features, rank), np.float32)
    columns = []
    for p, (name, width) in enumerate(zip(site.parts, site.widths, strict=True)):
        b_part = np.zeros((rank, width), np.float32)
        if name in parts:
            part_a, part_b = parts[name]
            r = part_a.shape[1]
            repeats = site.head_repeats[p] if site.head_repeats else 1
            if repeats > 1:
                part_b = repeat_kv_heads(part_b, part_b.shape[1] // site.head_dim, repeats, axis=1)
            a[:, p * max_rank : p * max_rank + r] = part_a
            b_part[p * max_rank : p * max_rank + r] = part_b
        columns.append(b_part)
    b = columns[0] if len(columns) == 1 else np.asarray(interleave_blocks(columns, site.blocks, axis=1))
    return a, b
