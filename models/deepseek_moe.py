# SPDX-License-Identifier: Apache-2.0
"""DeepSeek MoE: routed experts beside always-on shared experts, and DeepSeek's expert selection
(DeepSeek-V2/V3; GLM-4.5's MoE is V3's, configured by the same fields: `DeepseekMoeConfig`).

- V2 (`scoring_func="softmax"`): softmax over the experts, the top k of all of them (`greedy`:
  `moe.route` itself) or of the `topk_group` groups whose best expert scores highest
  (`group_limited_greedy`).
- V3 (`"sigmoid"`, `noaux_tc`): sigmoid scores; the choice adds `e_score_correction_bias` to
  them, keeps the `topk_group` groups whose two best biased scores sum highest, and takes the
  top k there; the weights are the unbiased scores of the chosen experts.

Then the weights are normalized to sum to 1 (`norm_topk_prob`), and the routed experts' sum is
multiplied by `routed_scaling_factor`. The routed experts are `moe.SparseMoE`'s (the sort-by-expert grouped
matmul, split on F under tensor parallelism); the shared experts are one dense gated MLP of
`n_shared_experts * moe_intermediate_size`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import GatedMLP
from models.linear import zeros_param
from models.metadata import AttentionMetadata
from models.moe import SparseMoE, route

_LAYER = "model.layers.{i}"
# The shared experts' projections under `model.layers.{i}.` (HF's names, which ours mirror).
SHARED_EXPERT_LINEARS = tuple(f"mlp.shared_experts.{name}" for name in ("gate_proj", "up_proj", "down_proj"))
# HF checkpoint name -> our parameter path of the router and the routed experts ("{i}" layer,
# "{e}" expert: fills slot e of a stacked kernel).
ROUTED_HF_PARAM_MAP = {
    f"{_LAYER}.mlp.gate.weight": f"{_LAYER}.mlp.router.kernel",
    f"{_LAYER}.mlp.gate.e_score_correction_bias": f"{_LAYER}.mlp.e_score_correction_bias",
    **{
        f"{_LAYER}.mlp.experts.{{e}}.{proj}.weight": f"{_LAYER}.mlp.experts.{proj}.kernel"
        for proj in ("gate_proj", "up_proj", "down_proj")
    },
}

# Expert selection: V2's softmax top-k, whole or from the best groups (`group_limited_greedy`);
# V3's sigmoid scores with a correction bias and group top-k (`noaux_tc`).
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True, slots=True)
class DeepseekMoeConfig(ModelConfig):
    """`ModelConfig` with DeepSeek MoE's fields: shared experts, expert selection (module
    docstring), and which layers route (`is_moe_layer`)."""

    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; supported: {TOPK_METHODS}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported: 'softmax' or 'sigmoid'")
        if self.num_experts and (self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group):
            raise ValueError(
                f"{self.num_experts} experts in n_group={self.n_group} groups with topk_group="
                f"{self.topk_group}: the groups must divide the experts and 1 <= topk_group <= n_group"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Routed experts from layer `first_k_dense_replace` on, every `moe_layer_freq`-th layer."""
        return (
            self.num_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        )


def moe_fields_from_hf(hf: dict[str, Any], *, topk_method: str, scoring_func: str) -> dict[str, Any]:
    """`DeepseekMoeConfig`'s fields (and the routed expert count) read from a `config.json`;
    `topk_method` and `scoring_func` where it does not name them."""
    n_group = hf.get("n_group") or 1
    return dict(
        num_experts=hf.get("n_routed_experts") or 0,
        n_shared_experts=hf.get("n_shared_experts") or 0,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        topk_method=hf.get("topk_method") or topk_method,
        scoring_func=hf.get("scoring_func") or scoring_func,
        n_group=n_group,
        topk_group=hf.get("topk_group") or n_group,
        first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
        moe_layer_freq=hf.get("moe_layer_freq") or 1,
    )


def route_grouped(
    router_logits: jax.Array,
    top_k: int,
    *,
    scoring: str,
    n_group: int,
    topk_group: int,
    correction_bias: jax.Array | None,
    renormalize: bool,
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's expert selection (module docstring), before `routed_scaling_factor`.

    Args:
      router_logits: `[T, E]`.
      correction_bias: `[E]` added to the scores for the choice only (V3), or None (V2).
    Returns:
      weights `[T, k]` float32 and expert ids `[T, k]` int32.
    """
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.reshape(t, n_group, e // n_group)  # [T, G, E / G]
        if correction_bias is None:
            group_scores = jnp.max(grouped, axis=-1)  # [T, G]
        else:
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, best_groups = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
        kept = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best_groups].set(True)
        kept = jnp.repeat(kept, e // n_group, axis=1)  # [T, E]
        choice = jnp.where(kept, choice, 0.0 if correction_bias is None else -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if renormalize:  # scores are positive: no zero sums
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class DeepseekMoE(SparseMoE):
    """`SparseMoE` routed by `route_grouped`, plus the shared experts' dense MLP."""

    def __init__(self, config: DeepseekMoeConfig, *, dtype: jnp.dtype):
        super().__init__(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            renormalize=config.norm_topk_prob, dtype=dtype, act=config.hidden_act,
        )  # fmt: skip
        grouped = config.topk_method != "greedy"
        self.scoring = config.scoring_func
        self.n_group, self.topk_group = (config.n_group, config.topk_group) if grouped else (1, 1)
        self.scaling = config.routed_scaling_factor
        # A float32 buffer in the checkpoint: small differences of it decide the experts.
        self.e_score_correction_bias = (
            zeros_param((config.num_experts,), jnp.float32) if config.topk_method == "noaux_tc" else None
        )
        shared = config.n_shared_experts * config.moe_intermediate_size
        self.shared_experts = (
            GatedMLP(config.hidden_size, shared, bias=False, dtype=dtype, act=config.hidden_act)
            if shared
            else None
        )

    def select_experts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The weights before `routed_scaling_factor`, which `__call__` applies to the routed sum.
        The router's logits stay float32 products (as transformers and vLLM compute them): rounded
        to bfloat16, their sigmoid scores would lose the small differences that decide the experts."""
        logits = self.router.product(x)
        if self.scoring == "softmax" and self.n_group == 1:  # plain softmax top-k
            return route(logits, self.top_k, renormalize=self.renormalize)
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        return route_grouped(
            logits, self.top_k, scoring=self.scoring, n_group=self.n_group, topk_group=self.topk_group,
            correction_bias=bias, renormalize=self.renormalize,
        )  # fmt: skip

    def __call__(
        self, x: jax.Array, md: AttentionMetadata | None = None, *, dense: bool = False
    ) -> jax.Array:
        # The scaling multiplies the routed sum, not each weight: the same product, and XLA's GPU
        # compiler fails on the scaled weights fused into the routed matmul's row gather.
        routed = super().__call__(x, md, dense=dense)
        if self.scaling != 1.0:
            routed = routed * jnp.asarray(self.scaling, routed.dtype)
        return routed if self.shared_experts is None else routed + self.shared_experts(x, md)


def deepseek_mlp(config: DeepseekMoeConfig, layer: int, *, dtype: jnp.dtype) -> nnx.Module:
    """Layer `layer`'s MLP: DeepSeek MoE where `config.is_moe_layer`, else the dense MLP."""
    if config.is_moe_layer(layer):
        return DeepseekMoE(config, dtype=dtype)
    return GatedMLP.from_config(config, dtype=dtype)
