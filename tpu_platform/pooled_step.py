# SPDX-License-Identifier: Apache-2.0
"""A pooling runner's programs: the jitted pooling (`tpu_platform.pooling`) at each step shape,
built at warm-up beside the forward programs and called on a dispatched step's hidden states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import ModelConfig
from tpu_platform.inputs import StepPlan
from tpu_platform.pooling import PoolingConfig, PoolingOptions, make_pooler, output_width, pooling_rows
from tpu_platform.programs import Programs, ProgramSpec


class PoolingPrograms:
    """The pooling program of one model, keyed `("pool", T, R)` in the runner's `Programs`."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        state_def: jax.tree_util.PyTreeDef,
        config: PoolingConfig,
        model_config: ModelConfig,
        dtype: jnp.dtype,
        whole: jax.sharding.Sharding | None,
    ):
        self.config = config
        self._jitted = make_pooler(graphdef, state_def, config)
        self._width = output_width(config, model_config.hidden_size, model_config.num_labels)
        self._hidden_size = model_config.hidden_size
        self._dtype = dtype
        self._whole = whole  # where the step's inputs live (None: the default device)

    def specs(self, state_leaves: list[jax.Array], shapes: list[tuple[int, int, int]]) -> list[ProgramSpec]:
        """One program per distinct `(T, R)` of the forward's padded step shapes."""
        return [self._spec(state_leaves, t, r) for t, r in dict.fromkeys((s[0], s[1]) for s in shapes)]

    def _spec(self, state_leaves, t_pad: int, r_pad: int, hidden=None, rows=None) -> ProgramSpec:
        if hidden is None:
            hidden = jax.ShapeDtypeStruct((t_pad, self._hidden_size), self._dtype, sharding=self._whole)
            rows = jax.ShapeDtypeStruct((4, r_pad), jnp.int32, sharding=self._whole)
        return ProgramSpec(
            key=("pool", t_pad, r_pad), jitted=self._jitted, args=(state_leaves, hidden, rows),
            context=repr(self.config),
        )  # fmt: skip

    def pool(
        self,
        programs: Programs,
        state_leaves: list[jax.Array],
        hidden: jax.Array,
        plan: StepPlan,
        options: list[PoolingOptions],
    ) -> jax.Array:
        """Dispatches the pooling of a step's `[T, D]` hidden states: `[R, N]` float32 rows."""
        rows = pooling_rows(plan.inputs().cu_q_lens, options, self._width, plan.shape[1])
        rows = jax.device_put(rows, self._whole)
        t_pad, r_pad = plan.shape[:2]
        return programs.call(
            ("pool", t_pad, r_pad),
            lambda: self._spec(state_leaves, t_pad, r_pad, hidden, rows),
            state_leaves,
            hidden,
            rows,
        )
