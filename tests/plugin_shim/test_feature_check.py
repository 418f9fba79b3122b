# SPDX-License-Identifier: Apache-2.0
"""Every vLLM feature the worker does not implement is refused at start, through vLLM's own
configuration path, by name; what works stays accepted; docs/features.md is the same list."""

import json
import pathlib
import re
import shutil
import types

import pytest
from vllm.engine.arg_utils import EngineArgs

from plugin_shim import feature_check
from plugin_shim.data_parallel import LINK_KEY
from tests.models.tiny_qwen3_next import save_tiny_qwen3_next
from tests.tiny_models import save_tiny_eagle3_head, save_tiny_eagle_head, save_tiny_llama

_DOC = pathlib.Path(__file__).parents[2] / "docs" / "features.md"

_WITHOUT_LINK = (
    "data_parallel_size_local below data_parallel_size, or data_parallel_rank (external / hybrid "
    "load balancing), without vllm-xla serve"
)

# Refused option -> (model variant, EngineArgs keywords that ask for it).
CASES = {
    "fully_sharded_loras": ("llama", dict(enable_lora=True, fully_sharded_loras=True)),
    "lora_target_modules": ("llama", dict(enable_lora=True, lora_target_modules=["o_proj"])),
    "enable_mixed_moe_lora_format": ("mixtral", dict(enable_lora=True, enable_mixed_moe_lora_format=True)),
    "enable_moe_shared_loras": ("mixtral", dict(enable_lora=True, enable_moe_shared_loras=True)),
    "enable_prompt_embeds": ("llama", dict(enable_prompt_embeds=True)),
    "quantization": ("llama", dict(quantization="fp8_per_tensor")),
    "quantization_config": (
        "llama",
        dict(quantization="fp8_per_channel", dtype="bfloat16", quantization_config={"ignore": ["lm_head"]}),
    ),
    "speculative_config": (
        "llama",
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 9, "prompt_lookup_max": 3}),
    ),
    "cpu_offload_gb": ("llama", dict(cpu_offload_gb=1)),
    "offload_group_size": ("llama", dict(offload_group_size=2, offload_num_in_group=1)),
    "pipeline_parallel_size": ("llama", dict(pipeline_parallel_size=2)),
    "data_parallel_size with nnodes": (
        "llama", dict(data_parallel_size=2, nnodes=2, tensor_parallel_size=2, master_addr="127.0.0.1"),
    ),
    _WITHOUT_LINK: (
        "mixtral", dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_address="10.0.0.2"),
    ),
    # vLLM wants tensor parallelism beyond the KV heads (2) for it: both are refused.
    "decode_context_parallel_size": ("llama", dict(decode_context_parallel_size=2, tensor_parallel_size=4)),
    "enable_expert_parallel with data_parallel_size, with LoRA, speculative decoding or pooling": (
        "mixtral", dict(enable_expert_parallel=True, data_parallel_size=2, enable_lora=True),
    ),
    "enable_eplb / expert_placement_strategy": (
        "mixtral", dict(enable_expert_parallel=True, expert_placement_strategy="round_robin"),
    ),
    "runner / convert": ("llama", dict(convert="classify")),  # a causal LM has no score head
    "kv_offloading_size": ("llama", dict(kv_offloading_size=1.0)),
    "kv_transfer_config": (
        "llama", dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
    ),
    "ec_transfer_config": (
        "llama", dict(ec_transfer_config={"ec_connector": "ECExampleConnector", "ec_role": "ec_both"}),
    ),
    "multimodal inputs": ("multimodal", {}),
    "hf_overrides": ("llama", dict(hf_overrides={"num_hidden_layers": 1})),
    "hf_config_path": ("llama", dict(hf_config_path="{model}")),
    "model_loader_extra_config": ("llama", dict(model_loader_extra_config={"enable_multithread_load": True})),
    "disable_sliding_window": ("llama", dict(disable_sliding_window=True)),
    "model_impl": ("llama", dict(model_impl="transformers")),
    "attention_backend": ("llama", dict(attention_backend="FLASH_ATTN")),
    "watermark_config": ("llama", dict(watermark_config={"key": 7})),
    "enable_return_routed_experts": ("mixtral", dict(enable_return_routed_experts=True)),
    "weight_transfer_config": ("llama", dict(weight_transfer_config={"backend": "nccl"})),
    "enable_lora with a hybrid model": ("qwen3_next", dict(enable_lora=True)),
    "runner with a hybrid model": ("qwen3_next", dict(runner="pooling", convert="embed")),
    "mamba_cache_dtype / mamba_ssm_cache_dtype": ("qwen3_next", dict(mamba_ssm_cache_dtype="bfloat16")),
}  # fmt: skip
# More ways of asking for a refused feature.
MORE_CASES = [
    ("quantization", "experts_int8_checkpoint", {}),  # a checkpoint's quantization_config
    ("quantization", "llama", dict(quantization="fp8_per_block", dtype="bfloat16")),
    ("speculative_config", "llama", dict(spec_method="ngram_gpu", spec_tokens=2)),
    ("runner / convert", "llama", dict(runner="pooling", convert="classify")),
    ("runner / convert", "classifier", dict(runner="generate")),  # no LM head to generate with
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Model directories: a tiny Llama with weights, and config-only variants of it (vLLM's
    configuration reads config.json and the tokenizer only)."""
    root = tmp_path_factory.mktemp("features")
    llama = save_tiny_llama(str(root / "llama"))
    config = json.loads((pathlib.Path(llama) / "config.json").read_text())
    variants = {
        "mixtral": dict(
            config, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
            num_experts_per_tok=2,
        ),
        "mixtral_8_heads": dict(
            config, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
            num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=8,
        ),
        "fp8_checkpoint": dict(
            config, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}
        ),
        "experts_int8_checkpoint": dict(
            config, quantization_config={"quant_method": "experts_int8"}
        ),
        "classifier": dict(config, architectures=["LlamaForSequenceClassification"], num_labels=3),
        "other_vocab": dict(config, vocab_size=512),
    }  # fmt: skip
    dirs = {"llama": llama, "multimodal": llama, "qwen3_next": save_tiny_qwen3_next(str(root / "qwen3_next"))}
    heads = {"eagle3_head": (llama, (0, 1, 2)), "hybrid_eagle3_head": (dirs["qwen3_next"], (1, 3, 4))}
    for name, (target, layers) in heads.items():
        dirs[name] = save_tiny_eagle3_head(str(root / name), target, seed=1, aux_layer_ids=layers)
    dirs["eagle_head"] = save_tiny_eagle_head(str(root / "eagle_head"), llama, seed=1)
    for name, variant in variants.items():
        path = root / name
        shutil.copytree(llama, path, ignore=shutil.ignore_patterns("*.safetensors"))
        (path / "config.json").write_text(json.dumps(variant))
        dirs[name] = str(path)
    return dirs


@pytest.fixture
def multimodal(monkeypatch):
    """vLLM inspects a multimodal architecture's classes, which import torchvision (not installed
    beside the CPU torch): the tiny text model stands in, reported multimodal by vLLM's own
    `ModelConfig.is_multimodal_model`."""
    from vllm.config.model import ModelConfig

    monkeypatch.setattr(ModelConfig, "is_multimodal_model", property(lambda self: True))


def _filled(value, names: dict[str, str]):
    """`value` with "{model}" the variant's checkpoint and "{llama}" (any of `models`) that one,
    in strings and in dicts' strings."""
    if isinstance(value, dict):
        return {k: _filled(v, names) for k, v in value.items()}
    return value.format(**names) if isinstance(value, str) else value


def _config(models: dict[str, str], variant: str, kwargs: dict):
    kwargs = {k: _filled(v, {**models, "model": models[variant]}) for k, v in kwargs.items()}
    return EngineArgs(model=models[variant], max_model_len=128, **kwargs).create_engine_config()


def test_every_refusal_has_a_case():
    assert sorted(CASES) == sorted(r.option for r in feature_check.REFUSED)


@pytest.mark.parametrize("refusal", feature_check.REFUSED, ids=lambda r: r.option)
def test_refused_at_engine_config_with_the_option_named(request, models, refusal):
    variant, kwargs = CASES[refusal.option]
    if variant == "multimodal":
        request.getfixturevalue("multimodal")
    with pytest.raises(ValueError) as raised:
        _config(models, variant, kwargs)
    assert feature_check.message(refusal) in str(raised.value)
    # Only what was asked for (decode context parallelism comes with tensor parallelism, which
    # is supported).
    assert str(raised.value).count("not supported by vllm-xla") == 1


@pytest.mark.parametrize(("open_inputs", "refused"), [(True, True), (False, False)])
def test_a_multimodal_model_is_served_text_only_when_vllm_takes_no_other_inputs(open_inputs, refused):
    # vLLM's `supports_multimodal_inputs` is false with --language-model-only or every modality's
    # limit at 0 (a real multimodal architecture's classes need torchvision, absent here).
    model = types.SimpleNamespace(
        is_multimodal_model=True, multimodal_config=object(), supports_multimodal_inputs=open_inputs
    )
    (refusal,) = [r for r in feature_check.REFUSED if r.option == "multimodal inputs"]
    assert refusal.detect(types.SimpleNamespace(model_config=model)) is refused


@pytest.mark.parametrize(("option", "variant", "kwargs"), MORE_CASES)
def test_refused_whichever_way_it_is_asked_for(models, option, variant, kwargs):
    (refusal,) = [r for r in feature_check.REFUSED if r.option == option]
    with pytest.raises(ValueError, match="not supported by vllm-xla") as raised:
        _config(models, variant, kwargs)
    assert feature_check.message(refusal) in str(raised.value)


@pytest.mark.parametrize(
    ("variant", "kwargs", "task"),
    [
        ("llama", dict(runner="pooling", convert="embed"), "embed"),
        ("llama", dict(runner="pooling"), "embed"),  # vLLM's default convert for a causal LM
        ("llama", dict(runner="pooling", pooler_config={"pooling_type": "MEAN"}), "embed"),
        ("classifier", {}, "classify"),  # a pooling architecture: vLLM resolves runner='pooling'
    ],
)
def test_pooling_runs_are_accepted(models, variant, kwargs, task):
    config = _config(models, variant, kwargs)
    assert feature_check.refusals(config) == []
    assert (config.model_config.runner_type, config.model_config.convert_type) == ("pooling", task)


def test_classifying_a_causal_lm_names_what_was_asked_and_the_way_out(models):
    with pytest.raises(ValueError) as raised:
        _config(models, "llama", dict(convert="classify"))
    text = str(raised.value)
    asked = "runner='pooling', convert='classify' (convert='classify' needs a *ForSequenceClassification"
    assert asked in text
    assert "convert='embed'" in text


def test_an_explicit_convert_none_under_runner_pooling_is_refused_by_vllm_first(models):
    """vLLM's own model check runs before any platform hook: refused at config all the same."""
    with pytest.raises(ValueError, match="does not support `--runner pooling`"):
        _config(models, "llama", dict(runner="pooling", convert="none"))


def test_several_refused_features_are_named_together(models):
    with pytest.raises(ValueError) as raised:
        _config(
            models,
            "llama",
            dict(enable_lora=True, fully_sharded_loras=True, cpu_offload_gb=2, hf_overrides={"x": 1}),
        )
    for option in ("fully_sharded_loras", "cpu_offload_gb", "hf_overrides"):
        assert f"{option} (" in str(raised.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64),
        dict(kv_cache_dtype="fp8", load_format="npcache", dtype="bfloat16", block_size=32),
        dict(kv_events_config={"enable_kv_cache_events": True, "publisher": "null"}),
        dict(async_scheduling=True, max_num_seqs=4, seed=3, max_logprobs=5, enforce_eager=True),
        dict(runner="generate", convert="none", model_impl="auto", tensor_parallel_size=1),
        dict(quantization="int8_per_channel_weight_only", dtype="bfloat16"),
        dict(quantization="fp8", dtype="bfloat16"),
        dict(quantization="fp8_per_channel", dtype="bfloat16"),
        dict(enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=4, lora_dtype="bfloat16"),
        dict(
            data_parallel_size=4,
            data_parallel_size_local=2,
            data_parallel_address="10.0.0.2",
            additional_config={LINK_KEY: "10.0.0.2:29551"},  # what `vllm-xla serve` adds
        ),
    ],
    ids=[
        "defaults",
        "prefix_chunked",
        "dtypes_npcache",
        "kv_events",
        "scheduling",
        "explicit_defaults",
        "int8",
        "fp8",
        "fp8_per_channel",
        "lora",
        "dense_replicas_across_hosts",
    ],
)
def test_what_works_stays_accepted(models, kwargs):
    config = _config(models, "llama", kwargs)
    assert feature_check.refusals(config) == []
    assert config.parallel_config.worker_cls == "plugin_shim.worker.XlaWorker"


def test_moe_model_is_accepted(models):
    assert feature_check.refusals(_config(models, "mixtral", {})) == []


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_parallelism_on_one_host_is_accepted(models, tp):
    config = _config(models, "mixtral", dict(enable_expert_parallel=True, tensor_parallel_size=tp))
    assert feature_check.refusals(config) == []
    assert config.parallel_config.enable_expert_parallel


@pytest.mark.parametrize(
    "hosts",
    [
        {},
        dict(data_parallel_size_local=1, data_parallel_address="10.0.0.2", additional_config={LINK_KEY: "x"}),
    ],
    ids=["one_host", "two_hosts"],
)
@pytest.mark.parametrize("tp", [1, 2])
def test_expert_parallelism_over_data_parallel_replicas_is_accepted(models, hosts, tp):
    options = dict(enable_expert_parallel=True, data_parallel_size=2, tensor_parallel_size=tp, **hosts)
    config = _config(models, "mixtral", options)
    assert feature_check.refusals(config) == []


def test_expert_parallelism_over_replicas_refuses_experts_that_do_not_split_over_all_their_devices(models):
    # the tiny Mixtral's 4 experts over 2 replicas of 4 devices (its 8 heads split 4 ways)
    options = dict(enable_expert_parallel=True, data_parallel_size=2, tensor_parallel_size=4)
    with pytest.raises(
        ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=4 cannot split .* 4 experts"
    ):
        _config(models, "mixtral_8_heads", options)


def test_a_mixture_of_experts_replicas_across_hosts_are_accepted_under_vllm_xla_serve(models):
    across = dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_address="10.0.0.2")
    config = _config(models, "mixtral", dict(**across, additional_config={LINK_KEY: "10.0.0.2:29551"}))
    assert feature_check.refusals(config) == []


# vLLM's own launch modes for replicas started one by one (it refuses external load balancing
# for a dense model itself): each rank its own API server, or each host's ranks.
_STARTED_ALONE = {
    "external_lb": dict(data_parallel_size=2, data_parallel_rank=1, enable_expert_parallel=True),
    "hybrid_lb": dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2),
}


@pytest.mark.parametrize("mode", sorted(_STARTED_ALONE))
def test_replicas_started_one_by_one_are_accepted_under_vllm_xla_serve_only(models, mode):
    options = _STARTED_ALONE[mode]
    linked = _config(models, "mixtral", dict(**options, additional_config={LINK_KEY: "127.0.0.1:29551"}))
    assert feature_check.refusals(linked) == []
    parallel = linked.parallel_config
    assert parallel.data_parallel_external_lb == (mode == "external_lb")
    assert parallel.data_parallel_hybrid_lb == (mode == "hybrid_lb")
    with pytest.raises(ValueError, match=re.escape(_WITHOUT_LINK)):
        _config(models, "mixtral", options)


_ACROSS_HOSTS = dict(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=29501)


def test_expert_parallelism_across_hosts_is_accepted_over_every_hosts_devices(models):
    config = _config(
        models, "mixtral", dict(enable_expert_parallel=True, tensor_parallel_size=4, **_ACROSS_HOSTS)
    )
    assert feature_check.refusals(config) == []
    # one worker a host; the experts split over the 4 devices of both (`parallel.MESH_TP_KEY`)
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.additional_config["xla_tensor_parallel_size"] == 4


@pytest.mark.parametrize("hosts", [{}, _ACROSS_HOSTS], ids=["one_host", "two_hosts"])
def test_expert_parallelism_refuses_experts_that_do_not_split(models, hosts):
    # the tiny Mixtral's 4 experts over 8 devices (8 heads of its width: they split 8 ways)
    with pytest.raises(ValueError, match="cannot split this model's 4 experts by index"):
        _config(models, "mixtral_8_heads", dict(enable_expert_parallel=True, tensor_parallel_size=8, **hosts))


def test_docs_table_is_the_list():
    assert _DOC.read_text() == feature_check.features_markdown(), (
        "docs/features.md is stale: python -m plugin_shim.feature_check > docs/features.md"
    )
    for refusal in feature_check.REFUSED:
        assert f"| `{refusal.option}` |" in _DOC.read_text()


@pytest.fixture(scope="module")
def gemma4(models, tmp_path_factory) -> str:
    """A config-only tiny Gemma 4 (sliding and full layers of different head dims), for which
    vLLM's own config step sets an attention backend."""
    import transformers

    from tests.models.tiny_checkpoints import _COMMON, TINY

    path = tmp_path_factory.mktemp("gemma4")
    shutil.copytree(models["llama"], path, ignore=shutil.ignore_patterns("*.safetensors", "config.json"),
                    dirs_exist_ok=True)  # fmt: skip
    config = transformers.Gemma4TextConfig(**{**_COMMON, **TINY["Gemma4ForCausalLM"][1]})
    config.architectures = ["Gemma4ForCausalLM"]
    config.save_pretrained(path)
    return str(path)


def test_the_attention_backend_vllm_sets_for_the_model_is_accepted(gemma4):
    config = EngineArgs(model=gemma4, max_model_len=128).create_engine_config()
    assert config.attention_config.backend is not None  # vLLM's Gemma 4 step set it
    assert feature_check.refusals(config) == []


def test_an_attention_backend_the_user_asks_for_is_refused_on_that_model_too(gemma4):
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(model=gemma4, max_model_len=128, attention_backend="FLASH_ATTN").create_engine_config()


def test_without_vllm_s_model_hooks_every_backend_counts_as_asked(gemma4, monkeypatch, caplog):
    import vllm.model_executor.models.config as hooks

    from tpu_platform import internals

    config = EngineArgs(model=gemma4, max_model_len=128).create_engine_config()
    internals.warn_fallback.cache_clear()
    monkeypatch.delattr(hooks, "MODELS_CONFIG_MAP")
    assert [r.option for r in feature_check.refusals(config)] == ["attention_backend"]
    assert "MODELS_CONFIG_MAP" in caplog.text
    internals.warn_fallback.cache_clear()


def test_an_fp8_checkpoint_is_accepted(models):
    """A checkpoint's `quant_method: fp8` config: vLLM's method "fp8", served as fp8 weights."""
    config = _config(models, "fp8_checkpoint", dict(dtype="bfloat16"))
    assert config.model_config.quantization == "fp8"
    assert feature_check.refusals(config) == []


def test_a_draft_model_is_served_split_as_the_target_and_refused_at_another_draft_tp(models):
    spec = {"method": "draft_model", "model": models["llama"], "num_speculative_tokens": 2}
    config = _config(models, "llama", dict(speculative_config=spec, tensor_parallel_size=2))
    assert feature_check.refusals(config) == []
    assert config.speculative_config.draft_tensor_parallel_size == 2  # vLLM's default: the target's
    one_device = {**spec, "draft_tensor_parallel_size": 1}
    with pytest.raises(ValueError, match="not supported by vllm-xla") as raised:
        _config(models, "llama", dict(speculative_config=one_device, tensor_parallel_size=2))
    assert "draft_tensor_parallel_size=1 with tensor_parallel_size=2" in str(raised.value)


def test_a_draft_model_of_the_targets_vocabulary_is_served_without_async_scheduling(models):
    spec = {"method": "draft_model", "model": models["llama"], "num_speculative_tokens": 2}
    config = _config(models, "llama", dict(speculative_config=spec))
    assert feature_check.refusals(config) == []
    assert config.scheduler_config.async_scheduling is False  # vLLM's default turns it on


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_head_is_served_without_async_scheduling_and_with_tensor_parallelism(models, method):
    spec = {"method": method, "model": models[f"{method}_head"], "num_speculative_tokens": 3}
    config = _config(models, "llama", dict(speculative_config=spec))
    assert feature_check.refusals(config) == []
    assert config.scheduler_config.async_scheduling is False  # vLLM's default turns it on
    split = _config(models, "llama", dict(speculative_config=spec, tensor_parallel_size=2))
    assert feature_check.refusals(split) == []


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "eagle3", "model": "{hybrid_eagle3_head}"},  # a head made for the hybrid
        {"method": "draft_model", "model": "{llama}"},
        {"method": "ngram", "prompt_lookup_max": 3},
    ],
    ids=lambda spec: spec["method"],
)
def test_a_hybrid_target_is_served_with_each_proposer_built_for_it(models, spec):
    # ('mtp' needs the checkpoint's own layer: `test_mtp_config.py`.)
    config = _config(models, "qwen3_next", dict(speculative_config={**spec, "num_speculative_tokens": 2}))
    assert feature_check.refusals(config) == []


def test_a_method_not_built_is_refused_by_name(models):
    spec = {"method": "ngram_gpu", "prompt_lookup_max": 3, "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="not supported by vllm-xla") as raised:
        _config(models, "llama", dict(speculative_config=spec))
    assert "method='ngram_gpu'" in str(raised.value)


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(models):
    spec = {"method": "draft_model", "model": models["other_vocab"], "num_speculative_tokens": 2}
    # vLLM's own check comes first (ours, `speculative.unsupported_speculation`, backs it).
    with pytest.raises(ValueError, match=r"vocab_size=384\. Draft model vocab_size=512"):
        _config(models, "llama", dict(speculative_config=spec))
