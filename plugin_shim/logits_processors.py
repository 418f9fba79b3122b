# SPDX-License-Identifier: Apache-2.0
"""Custom vLLM logits processors on our platform.

Processors installed through the `vllm.logits_processors` entry point or passed as
`LLM(..., logits_processors=[...])` are built once with `(vllm_config, device, is_pin_memory)`,
see every step's added and removed requests through `update_state`, and transform the logits
before our sampler. Batch indices are the runner's request-table rows, stable while a request
lives. The logits cross to a host torch tensor and back only when such a processor exists;
argmax-invariant processors are skipped when every row is greedy, as vLLM does. vLLM's built-in
processors (min_tokens, logit_bias, min_p) are not bridged: our jitted sampler implements them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import torch
from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, build_logitsprocs
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor

from tpu_platform.step_update import StepResult

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput


class LogitsProcessorBridge:
    """Feeds vLLM's logits-processor contract from our runner's steps."""

    def __init__(self, processors: list[LogitsProcessor]):
        self.processors = processors
        self._row_of: dict[str, int] = {}
        self._outputs: dict[str, list[int]] = {}
        self._batch_size = 0

    @classmethod
    def load(cls, vllm_config: VllmConfig) -> LogitsProcessorBridge | None:
        """The bridge for the custom processors configured or installed, or None when there are none."""
        built = build_logitsprocs(
            vllm_config, torch.device("cpu"), False, is_pooling_model=False,
            custom_logitsprocs=vllm_config.model_config.logits_processors or (),
        )  # fmt: skip
        custom = [p for p in built.all if type(p) not in BUILTIN_LOGITS_PROCESSORS]
        return cls(custom) if custom else None

    def update(self, so: SchedulerOutput, row_of: dict[str, int]) -> None:
        """Tells every processor which requests left and arrived (at which row) this step."""
        removed = [self._row_of.pop(r) for r in so.finished_req_ids if r in self._row_of]
        for r in so.finished_req_ids:
            self._outputs.pop(r, None)
        added = []
        for new in so.scheduled_new_reqs:
            outputs: list[int] = []
            self._outputs[new.req_id] = outputs
            self._row_of[new.req_id] = row_of[new.req_id]
            added.append((row_of[new.req_id], new.sampling_params, new.prompt_token_ids, outputs))
        self._batch_size = max(self._row_of.values(), default=-1) + 1
        batch = BatchUpdate(self._batch_size, removed, added, []) if removed or added else None
        for processor in self.processors:
            processor.update_state(batch)

    def apply(self, logits: jax.Array, rows: np.ndarray, all_greedy: bool) -> jax.Array:
        """`logits[i]` belongs to table row `rows[i]` (rows past `len(rows)` are padding)."""
        active = [p for p in self.processors if not (all_greedy and p.is_argmax_invariant())]
        if not active:
            return logits
        host = np.array(logits)
        batch = torch.zeros((self._batch_size, host.shape[1]), dtype=torch.float32)
        index = torch.from_numpy(rows.astype(np.int64))
        batch[index] = torch.from_numpy(host[: rows.size])
        for processor in active:
            batch = processor.apply(batch)
        host[: rows.size] = batch[index].numpy()
        return jnp.asarray(host)

    def record(self, result: StepResult) -> None:
        """Appends this step's tokens to the output lists the processors hold references to."""
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True):
            if req_id in self._outputs:
                self._outputs[req_id].extend(tokens)
