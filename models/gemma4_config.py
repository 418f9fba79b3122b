# SPDX-License-Identifier: Apache-2.0
"""Gemma 4 text configuration: what `Gemma4TextConfig` (transformers) adds to `ModelConfig`.

Each layer is a sliding (`sliding_attention`) or a full (`full_attention`) one, and the two
kinds differ in head dim (full layers: `global_head_dim`, 512 in the released models), in KV
heads (`num_global_key_value_heads` on full layers when `attention_k_eq_v`, whose full layers
also reuse the key projection as values) and in RoPE (`rope_parameters` by layer kind; full
layers' "proportional" RoPE rotates a fraction of the pairs). transformers writes the per-layer
shapes to `config.json` as `per_layer_config` (layer index -> overrides); a config written
before that names `global_head_dim` / `num_global_key_value_heads`; both are read.

`ModelConfig.head_dim` and `num_kv_heads` are the KV cache's: the widest head dim and the most
KV heads of any layer. Every layer's cache has that shape (one page size for vLLM's block
manager, one array shape for the runner); a layer with a narrower head pads its keys, values
and queries with zeros (which leave the scores and its own output dims unchanged) and one with
fewer KV heads repeats each, as tensor parallelism does.

The last `num_kv_shared_layers` layers compute no keys or values: each attends over the cache
of the last earlier layer of its kind (`kv_source`).

With `enable_moe_block` (gemma-4-26B-A4B) every layer has, beside its dense MLP, `num_experts`
routed experts of `moe_intermediate_size`, `top_k_experts` of them a token (read into
`ModelConfig`'s `num_experts`, `num_experts_per_tok` and `moe_intermediate_size`).

A `Gemma4ForConditionalGeneration` config (the released checkpoints') nests the text model's
as `text_config`: that one is read, the vision and audio towers' are not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig
from models.rope import ProportionalRope, Rope

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclasses.dataclass(frozen=True, slots=True)
class Gemma4Config(ModelConfig):
    """`ModelConfig` (cache shape in `head_dim` / `num_kv_heads`) with Gemma 4's per-layer facts."""

    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    # Whether a full layer's values are its (un-normed) keys: no v_proj.
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    # Per-layer input embeddings (0: none): each layer's `[P]` slice of a `[V, L * P]` table.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # The KV-shared layers' MLPs are twice as wide.
    double_wide_mlp: bool = False
    sliding_rope: Rope | ProportionalRope | None = None
    full_rope: Rope | ProportionalRope | None = None

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> Gemma4Config:
        if "text_config" in hf:  # Gemma4ForConditionalGeneration: its text model's config
            hf = {**hf["text_config"], "architectures": hf.get("architectures")}
        _refuse_unbuilt(hf)
        ropes = hf.get("rope_parameters") or {}
        # The base parser reads one RoPE; Gemma 4's are read below, by layer kind.
        base = ModelConfig.from_hf_dict.__func__(cls, {**hf, "rope_parameters": None, **_moe_fields(hf)})
        kinds = _layer_kinds(hf, base.num_layers)
        head_dims, kv_heads = _layer_shapes(hf, kinds, base.head_dim, base.num_kv_heads)
        cache_kv_heads = max(kv_heads)
        if any(cache_kv_heads % k for k in kv_heads):
            raise ValueError(
                f"Gemma 4 layers with {sorted(set(kv_heads))} KV heads cannot share one cache shape "
                f"({cache_kv_heads} heads); this checkpoint is not supported"
            )
        shared = int(hf.get("num_kv_shared_layers") or 0)
        unshared = kinds[: base.num_layers - shared]
        if any(kind not in unshared for kind in kinds[base.num_layers - shared :]):
            raise ValueError(
                f"num_kv_shared_layers={shared} leaves a KV-shared layer no earlier layer of its kind"
            )
        window = int(hf.get("sliding_window") or 512)
        return dataclasses.replace(
            base,
            layer_sliding_windows=tuple(window if kind == SLIDING else None for kind in kinds),
            head_dim=max(head_dims),
            num_kv_heads=cache_kv_heads,
            layer_head_dims=head_dims,
            layer_kv_heads=kv_heads,
            attention_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
            num_kv_shared_layers=shared,
            per_layer_input_size=int(hf.get("hidden_size_per_layer_input") or 0),
            per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input") or base.vocab_size),
            double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
            sliding_rope=_rope(ropes.get(SLIDING) or {"rope_type": "default", "rope_theta": 10_000.0}),
            full_rope=_rope(
                ropes.get(FULL)
                or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
            ),
        )

    @property
    def dense_mlp_beside_experts(self) -> bool:
        """Every layer keeps its dense MLP (`intermediate_size`) beside any routed experts."""
        return True

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def is_full(self, layer: int) -> bool:
        return self.layer_sliding_windows[layer] is None

    def kv_source(self, layer: int) -> int:
        """The layer whose cache `layer` attends over: itself, or for a KV-shared layer the last
        earlier (unshared) layer of its kind, as transformers and vLLM pick it."""
        first = self.first_kv_shared_layer
        if layer < first:
            return layer
        kind = self.is_full(layer)
        return max(i for i in range(first) if self.is_full(i) == kind)

    def mlp_size(self, layer: int) -> int:
        wide = self.double_wide_mlp and self.num_kv_shared_layers and layer >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if wide else 1)

    def layer_rope(self, layer: int) -> Rope | ProportionalRope:
        return self.full_rope if self.is_full(layer) else self.sliding_rope


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE block's fields under `ModelConfig.from_hf_dict`'s names (none: a dense model)."""
    if not hf.get("enable_moe_block"):
        return {"num_experts": None, "num_local_experts": None}
    # vLLM reads the experts' size under either name.
    size = hf.get("moe_intermediate_size") or hf.get("expert_intermediate_size")
    fields = {"num_experts": hf.get("num_experts"), "top_k_experts": hf.get("top_k_experts")}
    missing = [name for name, value in {**fields, "moe_intermediate_size": size}.items() if not value]
    if missing:
        raise ValueError(
            f"Gemma 4 config with enable_moe_block lacks {missing}: the checkpoint's config.json "
            "must name its experts, how many route a token and their intermediate size"
        )
    return {
        "num_experts": int(fields["num_experts"]),
        "num_local_experts": None,
        "num_experts_per_tok": int(fields["top_k_experts"]),
        "moe_intermediate_size": int(size),
    }


def _refuse_unbuilt(hf: dict[str, Any]) -> None:
    """Gemma 4 variants vllm-xla does not build, refused by name."""
    if hf.get("use_bidirectional_attention") == "all":
        raise ValueError(
            "Gemma 4 with use_bidirectional_attention='all' is not supported by vllm-xla: it "
            "serves causal text generation; leave it unset"
        )


def _layer_kinds(hf: dict[str, Any], num_layers: int) -> list[str]:
    kinds = list(hf.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    kinds[-1] = FULL  # as transformers forces it
    return kinds


def _layer_shapes(
    hf: dict[str, Any], kinds: list[str], head_dim: int, num_kv_heads: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's head dim and KV heads: `per_layer_config` overrides, else the full layers'
    `global_head_dim` (and `num_global_key_value_heads` with `attention_k_eq_v`)."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        full: dict[str, int] = {"head_dim": int(hf.get("global_head_dim") or 512)}
        if hf.get("attention_k_eq_v", True) and hf.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(hf["num_global_key_value_heads"])
        overrides = {str(i): full for i, kind in enumerate(kinds) if kind == FULL}
    layers = [overrides.get(str(i)) or overrides.get(i) or {} for i in range(len(kinds))]
    return (
        tuple(int(o.get("head_dim", head_dim)) for o in layers),
        tuple(int(o.get("num_key_value_heads", num_kv_heads)) for o in layers),
    )


def _rope(params: dict[str, Any]) -> Rope | ProportionalRope:
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10_000.0))
    if kind == "default":
        return Rope(theta)
    if kind == "proportional":
        return ProportionalRope(
            theta, float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0))
        )
    raise ValueError(f"Gemma 4 rope_type {kind!r} is not supported; supported: 'default', 'proportional'")
