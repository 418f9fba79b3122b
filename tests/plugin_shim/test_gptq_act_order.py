# SPDX-License-Identifier: Apache-2.0
"""The platform's quantization method for GPTQ act-order checkpoints (`plugin_shim.gptq_act_order`):
it claims exactly the grouped desc_act GPTQ configs that vLLM's own GPTQ refuses, and vLLM then
resolves the method by its name (`test_int4_engine` serves such a checkpoint through `vllm.LLM`)."""

import pytest

from plugin_shim.gptq_act_order import GptqActOrderConfig, register_gptq_act_order
from tpu_platform.runner_config import GPTQ_ACT_ORDER, QUANTIZATION_METHODS

_ACT_ORDER = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}


@pytest.mark.parametrize(
    ("config", "user", "claimed"),
    [
        (_ACT_ORDER, None, True),
        (_ACT_ORDER, "gptq", True),
        (_ACT_ORDER, "awq", False),  # the user asked for another method: vLLM names the mismatch
        ({**_ACT_ORDER, "desc_act": False}, None, False),  # vLLM's GPTQ serves it
        ({**_ACT_ORDER, "group_size": -1}, None, False),  # per channel: vLLM drops desc_act itself
        ({**_ACT_ORDER, "quant_method": "awq"}, None, False),
    ],
)
def test_it_claims_grouped_act_order_gptq_only(config, user, claimed):
    assert (GptqActOrderConfig.override_quantization_method(config, user) == GPTQ_ACT_ORDER) is claimed


def test_vllm_resolves_the_registered_method_once():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS as VLLM_METHODS
    from vllm.model_executor.layers.quantization import get_quantization_config

    register_gptq_act_order()
    register_gptq_act_order()
    assert VLLM_METHODS.count(GPTQ_ACT_ORDER) == 1 and GPTQ_ACT_ORDER in QUANTIZATION_METHODS
    config = get_quantization_config(GPTQ_ACT_ORDER).from_config(_ACT_ORDER)
    assert config.get_name() == GPTQ_ACT_ORDER and config.config == _ACT_ORDER
