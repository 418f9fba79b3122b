# SPDX-License-Identifier: Apache-2.0
"""vLLM's pooling parameters as the runner's options: honoured ones carried over, the rest refused
by name (also through the platform's request check)."""

import pytest
from vllm.pooling_params import PoolingParams

from plugin_shim.platform import XlaPlatform
from plugin_shim.pooling import pooling_options, supported_tasks
from tpu_platform.pooling import PoolingConfig, PoolingOptions


def test_dimensions_and_activation_are_carried_over():
    assert pooling_options(PoolingParams(task="embed", dimensions=8)) == PoolingOptions(8, True)
    unactivated = PoolingParams(task="classify", use_activation=False)
    assert pooling_options(unactivated) == PoolingOptions(None, False)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        (PoolingParams(task="token_embed"), "pooling task 'token_embed'"),
        (PoolingParams(task="plugin"), "pooling task 'plugin'"),
        (PoolingParams(task="embed", step_tag_id=3), "PoolingParams.step_tag_id=3"),
        (PoolingParams(task="embed", returned_token_ids=[1, 2]), "PoolingParams.returned_token_ids"),
        (PoolingParams(task="embed", extra_kwargs={"x": 1}), "PoolingParams.extra_kwargs"),
    ],
)
def test_what_the_runner_cannot_honour_is_refused_by_name(params, named):
    with pytest.raises(ValueError, match="not supported by vllm-xla") as raised:
        pooling_options(params)
    assert named in str(raised.value)
    with pytest.raises(ValueError, match="not supported by vllm-xla"):
        XlaPlatform.validate_request(None, params)


def test_a_pooling_engine_supports_its_one_task():
    assert supported_tasks(None) == ("generate",)
    assert supported_tasks(PoolingConfig(task="classify")) == ("classify",)
