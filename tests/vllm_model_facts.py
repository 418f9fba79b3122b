# SPDX-License-Identifier: Apache-2.0
"""Fills vLLM's cache of model-class facts for the architectures the tests serve, in one process.

vLLM reads facts about an architecture's torch class (pooling, multimodal, pipeline parallel...)
in a fresh Python process the first time a machine meets that architecture, to keep CUDA out of
its own process, and keeps them under its cache directory (`modelinfos/`). On a clean machine
every architecture the tests serve would cost a process importing vLLM and torch, on the test's
time, some of them in two workers at once. `tests/conftest.py` starts this module beside the
workers' collection instead (`python -m tests.vllm_model_facts`): one process reads every
architecture's facts in turn and leaves vLLM's own cache files. Facts already cached are read,
not computed again; an architecture missing from vLLM's registry, or whose class does not import
here, is left to vLLM.
"""

from __future__ import annotations

import json

from models.architectures import SUPPORTED_ARCHITECTURES

# vLLM's classes the tests meet besides the served architectures: speculative decoding's heads and
# MTP layers, and the ones refusal tests name (`test_feature_check.py`, `test_flax_model_plugin.py`).
OTHER_CLASSES = (
    "Phi3ForCausalLM",
    "EagleLlamaForCausalLM",
    "Eagle3LlamaForCausalLM",
    "DeepSeekMTPModel",
    "TransformersForCausalLM",
    "TransformersForSequenceClassification",
)


def fill(architectures: tuple[str, ...]) -> list[str]:
    """Reads each architecture's facts through vLLM's registry in this process; the ones read."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry

    # vLLM's own inspection, run here instead of in a process of its own (this one is that
    # process). Without the name (another vLLM), each inspection starts its process as usual.
    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = lambda read: read()
    read = []
    for architecture in architectures:
        model = ModelRegistry.models.get(architecture)
        if model is None or not hasattr(model, "inspect_model_cls"):
            continue
        try:
            model.inspect_model_cls()
        except Exception:  # left to vLLM, which reports it where a test meets it
            continue
        read.append(architecture)
    return read


if __name__ == "__main__":
    print(json.dumps(fill(tuple(SUPPORTED_ARCHITECTURES) + OTHER_CLASSES)))
