# SPDX-License-Identifier: Apache-2.0
"""Pooling: one vector per request from the forward's hidden states (embeddings, classification).

A pooling engine runs the same forward step as a generating one; a second jitted program, one per
step shape `(T, R)` built at warm-up, turns the step's `[T, D]` hidden states into `[R, N]` rows:
the sequence's last token (`LAST`), its first (`CLS`) or the mean over its tokens (`MEAN`), then
the head. `embed`: the first `dimensions` columns kept (Matryoshka truncation; the others zeroed)
and L2-normalized when the request asks for its activation. `classify`: the model's score head,
vLLM's affine calibration `(logits - logit_mean) / logit_sigma`, then its activation (softmax,
sigmoid or none). Per-request options are arrays (`PoolingRows`): new values never recompile.

A request's row is read only on the step that reaches the end of its prompt. `MEAN` and `CLS`
need the whole prompt in that step: vLLM turns chunked prefill and prefix caching off for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

POOLING_METHODS = ("LAST", "CLS", "MEAN")
POOLING_TASKS = ("embed", "classify")
ACTIVATIONS = ("softmax", "sigmoid", "identity")


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How a pooling engine pools, fixed for its lifetime (vLLM's `PoolerConfig`, resolved)."""

    task: str  # "embed" or "classify"
    method: str = "LAST"  # "LAST", "CLS" or "MEAN"
    # classify only: the head's activation, and vLLM's affine calibration of its logits
    activation: str = "softmax"
    logit_mean: float | None = None
    logit_sigma: float | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task {self.task!r} is not supported; supported: {POOLING_TASKS}")
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling type {self.method!r} is not supported; supported: {POOLING_METHODS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported; supported: {ACTIVATIONS}")
        if self.logit_sigma == 0:
            raise ValueError("logit_sigma must not be 0")


@dataclasses.dataclass(frozen=True)
class PoolingOptions:
    """One request's options: `dimensions` kept (None: all), and whether its activation applies
    (normalization for `embed`, the classifier's activation for `classify`). A request that must
    end without a vector (its LoRA adapter could not be read at its step) has `answered` False:
    its row is empty."""

    dimensions: int | None = None
    activation: bool = True
    answered: bool = True


# Rows of the `[4, R]` int32 array a pooling program takes (one transfer a step).
_START, _END, _DIMS, _ACTIVATE = range(4)


def pooling_rows(
    cu_q_lens: np.ndarray, options: Sequence[PoolingOptions], width: int, padded_rows: int
) -> np.ndarray:
    """The `[4, R]` per-row inputs of a step: each sequence's first and end token in the step
    (from the step's query offsets `cu_q_lens`), columns kept (`width`, the output's, for all) and
    whether to activate. Padding rows pool an empty span."""
    rows = np.zeros((4, padded_rows), np.int32)
    n = len(options)
    rows[_START, :n] = cu_q_lens[:n]
    rows[_END, :n] = cu_q_lens[1 : n + 1]
    rows[_DIMS, :] = width
    rows[_ACTIVATE, :n] = [o.activation for o in options]
    dims = [o.dimensions for o in options]
    rows[_DIMS, :n] = [width if d is None else d for d in dims]
    return rows


def pool_hidden(hidden: jax.Array, rows: jax.Array, method: str) -> jax.Array:
    """`[T, D]` hidden states to `[R, D]` float32, one row per sequence (`pooling_rows`)."""
    starts, ends = rows[_START], rows[_END]
    if method == "LAST":
        return hidden[jnp.maximum(ends - 1, 0)].astype(jnp.float32)
    if method == "CLS":
        return hidden[starts].astype(jnp.float32)
    tokens = jnp.arange(hidden.shape[0])
    inside = (tokens[None, :] >= starts[:, None]) & (tokens[None, :] < ends[:, None])
    total = jnp.dot(
        inside.astype(jnp.float32), hidden.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return total / jnp.maximum(ends - starts, 1)[:, None].astype(jnp.float32)


def embed_head(pooled: jax.Array, rows: jax.Array) -> jax.Array:
    """Matryoshka truncation (columns past a row's `dimensions` zeroed), then, where asked,
    L2 normalization as torch's `F.normalize` (norm floored at 1e-12)."""
    kept = jnp.arange(pooled.shape[1])[None, :] < rows[_DIMS][:, None]
    pooled = jnp.where(kept, pooled, 0.0)
    norm = jnp.sqrt(jnp.sum(pooled * pooled, axis=1, keepdims=True))
    normalized = pooled / jnp.maximum(norm, 1e-12)
    return jnp.where(rows[_ACTIVATE][:, None] > 0, normalized, pooled)


def classify_head(logits: jax.Array, rows: jax.Array, config: PoolingConfig) -> jax.Array:
    """vLLM's classifier head on `[R, L]` float32 logits: calibration, then the activation where asked."""
    if config.logit_mean is not None:
        logits = logits - config.logit_mean
    if config.logit_sigma is not None:
        logits = logits / config.logit_sigma
    if config.activation == "softmax":
        activated = jax.nn.softmax(logits, axis=-1)
    elif config.activation == "sigmoid":
        activated = jax.nn.sigmoid(logits)
    else:
        activated = logits
    return jnp.where(rows[_ACTIVATE][:, None] > 0, activated, logits)


def make_pooler(
    graphdef: nnx.GraphDef, state_def: jax.tree_util.PyTreeDef, config: PoolingConfig
) -> Callable:
    """`pool(state_leaves, hidden[T, D], rows[4, R]) -> [R, N]` float32, jitted (N: the hidden
    size for `embed`, the labels for `classify`, whose head is the model's `compute_logits`)."""

    def pool(state_leaves: list[jax.Array], hidden: jax.Array, rows: jax.Array) -> jax.Array:
        pooled = pool_hidden(hidden, rows, config.method)
        if config.task == "embed":
            return embed_head(pooled, rows)
        model = nnx.merge(graphdef, jax.tree.unflatten(state_def, state_leaves))
        logits = model.compute_logits(pooled.astype(hidden.dtype)).astype(jnp.float32)
        return classify_head(logits, rows, config)

    return jax.jit(pool)


def output_width(config: PoolingConfig, hidden_size: int, num_labels: int) -> int:
    """Columns of a pooled row."""
    return hidden_size if config.task == "embed" else num_labels


class PoolingRequests:
    """The options of the requests a pooling runner serves, by request id."""

    def __init__(self) -> None:
        self._options: dict[str, PoolingOptions] = {}

    def add(self, req_id: str, options: PoolingOptions) -> None:
        self._options[req_id] = options

    def remove(self, req_id: str) -> None:
        self._options.pop(req_id, None)

    def options(self, req_ids: Sequence[str]) -> list[PoolingOptions]:
        missing = [r for r in req_ids if r not in self._options]
        if missing:
            raise ValueError(f"requests {missing[:3]} reached a pooling runner without pooling options")
        return [self._options[r] for r in req_ids]


def pooled_outputs(
    pooled: np.ndarray, emits: np.ndarray, options: Sequence[PoolingOptions]
) -> list[np.ndarray | None]:
    """Each sequence's row (its `dimensions` columns; none for a request not `answered`), where
    the step reached its prompt's end; None for a partial prefill chunk."""
    out: list[np.ndarray | None] = []
    for i, (done, o) in enumerate(zip(emits.tolist(), options, strict=True)):
        width = o.dimensions if o.answered else 0
        out.append(pooled[i, :width].copy() if done else None)
    return out
