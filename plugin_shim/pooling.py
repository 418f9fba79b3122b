# SPDX-License-Identifier: Apache-2.0
"""vLLM's pooling runner on the XLA worker: its configuration, requests and outputs translated.

vLLM decides what a pooling engine serves (`runner="pooling"`: it never generates, and vLLM
refuses `generate` on it) and how it schedules (chunked prefill and prefix caching off for `MEAN`
and `CLS` pooling). The worker serves the sequence-wise tasks, `embed` (a causal LM's checkpoint
with `convert="embed"`) and `classify` (a `*ForSequenceClassification` checkpoint's score head),
with `tpu_platform.pooling`'s jitted pooling; anything else is refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from tpu_platform.pooling import POOLING_TASKS, PoolingConfig, PoolingOptions

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.pooling_params import PoolingParams
    from vllm.v1.core.sched.output import SchedulerOutput

    from tpu_platform.runner import Runner
    from tpu_platform.step_update import StepUpdate

# PoolingParams fields the worker cannot honour, with the values that mean "not used".
_UNSUPPORTED = {
    "step_tag_id": (None,),
    "returned_token_ids": (None, []),
    "late_interaction_params": (None,),
    "requires_token_ids": (False,),
    "extra_kwargs": (None, {}),
}


def is_classifier(model_config: ModelConfig) -> bool:
    """Whether the checkpoint has a sequence classifier's score head."""
    architectures = getattr(model_config.hf_config, "architectures", None) or [""]
    return architectures[0].endswith("ForSequenceClassification")


def unsupported_pooling(model_config: ModelConfig) -> str | None:
    """Why this platform cannot serve `model_config`'s pooling, or None (also for a generating
    engine of a causal LM)."""
    if model_config.runner_type != "pooling":
        if is_classifier(model_config):
            return (
                "a *ForSequenceClassification checkpoint has no LM head to generate with; "
                "use runner='pooling'"
            )
        return None
    convert = model_config.convert_type
    if convert == "classify" and not is_classifier(model_config):
        return (
            "convert='classify' needs a *ForSequenceClassification checkpoint (its score weight); "
            "serve one (Llama, Qwen3), or embed with convert='embed'"
        )
    if convert not in POOLING_TASKS:
        return (
            f"a pooling architecture of its own ({model_config.architecture}, convert={convert!r}); "
            "serve a causal LM with convert='embed' or a *ForSequenceClassification checkpoint"
        )
    seq_type = model_config.pooler_config.seq_pooling_type
    if seq_type not in ("LAST", "CLS", "MEAN"):
        return f"pooling_type {seq_type!r}; use LAST, CLS or MEAN"
    return None


def pooling_config(vllm_config: VllmConfig) -> PoolingConfig | None:
    """The runner's pooling for a pooling engine (vLLM's resolved `pooler_config`), else None."""
    mc = vllm_config.model_config
    if mc.runner_type != "pooling":
        return None
    why = unsupported_pooling(mc)
    if why is not None:
        raise ValueError(f"vllm-xla cannot serve this pooling model: {why}")
    pooler = mc.pooler_config
    task = mc.convert_type
    return PoolingConfig(
        task=task,
        method=pooler.seq_pooling_type,
        activation=classifier_activation(mc) if task == "classify" else "identity",
        logit_mean=pooler.logit_mean,
        logit_sigma=pooler.logit_sigma,
    )


def classifier_activation(model_config: ModelConfig) -> str:
    """vLLM's classifier activation for the checkpoint (`get_act_fn`), as `tpu_platform.pooling` names it."""
    from vllm.model_executor.layers.pooler.activations import (
        PoolerClassify,
        PoolerIdentity,
        PoolerMultiLabelClassify,
        get_act_fn,
    )

    act = get_act_fn(model_config.hf_config)
    if isinstance(act, PoolerIdentity):
        return "identity"
    if isinstance(act, PoolerMultiLabelClassify):
        return "sigmoid"
    if isinstance(act, PoolerClassify):
        return "sigmoid" if (act.num_labels or 0) < 2 else "softmax"
    fn = getattr(act, "fn", None)
    named = {torch.nn.Sigmoid: "sigmoid", torch.nn.Identity: "identity"}
    for cls, name in named.items():
        if isinstance(fn, cls):
            return name
    if isinstance(fn, torch.nn.Softmax) and fn.dim in (-1, 1, None):
        return "softmax"
    raise ValueError(
        f"the checkpoint's classifier activation {fn!r} is not supported by vllm-xla; "
        "supported: Sigmoid, Softmax, Identity"
    )


def supported_tasks(config: PoolingConfig | None) -> tuple[str, ...]:
    return ("generate",) if config is None else (config.task,)


def pooling_options(params: PoolingParams) -> PoolingOptions:
    """The runner's options for vLLM `params`; a ValueError names anything unsupported."""
    if params.task is not None and params.task not in POOLING_TASKS:
        raise ValueError(
            f"pooling task {params.task!r} is not supported by vllm-xla; supported: "
            f"{', '.join(POOLING_TASKS)} (one vector a request: LLM.embed, LLM.classify, LLM.score)"
        )
    for name, unused in _UNSUPPORTED.items():
        value = getattr(params, name, None)
        if value not in unused:
            raise ValueError(f"PoolingParams.{name}={value!r} is not supported by vllm-xla; leave it unset")
    activation = True if params.use_activation is None else bool(params.use_activation)
    return PoolingOptions(dimensions=params.dimensions, activation=activation)


def execute_pooling(
    runner: Runner, scheduler_output: SchedulerOutput, update: StepUpdate
) -> ModelRunnerOutput:
    """One step of a pooling engine: the forward (each new request brings its pooling options
    in `update`), then the pooled rows."""
    for request in update.new_requests:
        if request.pooling is None:
            raise ValueError(
                f"request {request.req_id!r} reached a pooling engine without pooling parameters"
            )
    runner.execute(update)
    if not scheduler_output.total_num_scheduled_tokens:
        return EMPTY_MODEL_RUNNER_OUTPUT
    req_ids, rows = runner.pool()
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        pooler_output=[None if row is None else torch.from_numpy(row) for row in rows],
    )
