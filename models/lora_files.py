# SPDX-License-Identifier: Apache-2.0
"""PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors`) read with
NumPy into one slot's values per adapter site (`models.lora`), checked against the model: every
problem is a ValueError naming the adapter, the tensor or module, and the fix.

An adapter's values enter slots every row of a step shares, so a value that is not finite, or
that the slot dtype cannot hold, is refused here rather than left to turn a step's outputs NaN."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from models.lora import SUPPORTED_TARGETS, LoraSite, site_slot_values
from models.lora_targets import PatternError, compile_target_pattern

# `base_model.model.<module>.lora_A.weight` (PEFT strips the adapter's name when saving; an
# unstripped `lora_A.<name>.weight` is taken too).
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# Options that change what the adapter computes beyond `B @ A * scaling`: refused, not ignored.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora) adapters",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer replication",
}


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """An adapter ready for a slot: `site -> (a [in, P * R], b [P * R, out])` in float32 (the
    scaling folded into b), for the sites it targets; `rank` and `scaling` as read."""

    name: str
    rank: int
    scaling: float
    slot_values: dict[str, tuple[np.ndarray, np.ndarray]]
    targets: tuple[str, ...]  # the HF module short names it adapts


def read_adapter(
    name: str,
    path: str,
    sites: dict[str, LoraSite],
    max_rank: int,
    slot_dtype: np.dtype | str = np.float32,
) -> LoraAdapter:
    """Reads the PEFT adapter `name` at `path` for a model whose adapter sites are `sites` and
    whose slots hold `slot_dtype`.

    Refused by name: a missing file, a non-LoRA PEFT type, a rank above `max_rank`, options
    that change the computation (DoRA, biases, modules_to_save, ...), a tensor for a module that
    cannot carry an adapter (e.g. embed_tokens, lm_head) or that the model lacks, an A without
    its B (or the reverse), a target module left without its tensors, a shape that does not
    fit the module, a non-finite `r`/`lora_alpha` or tensor value, a value (B scaled) beyond
    what `slot_dtype` holds, and a `target_modules` pattern `models.lora_targets` does not run."""
    config = _adapter_config(name, path)
    rank = _number(name, config, "r", 8)
    if rank != int(rank) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r={rank!r} is not a positive integer rank")
    rank = int(rank)
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: rank r={rank} exceeds max_lora_rank={max_rank}; start the engine "
            f"with max_lora_rank >= {rank}"
        )
    alpha = _number(name, config, "lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _adapter_tensors(name, path)
    parts = _parts(name, tensors, sites, max_rank, scaling)
    _check_values(name, parts, np.dtype(slot_dtype))
    targets = sorted({module.rsplit(".", 1)[1] for module in parts})
    _check_targets(name, config, parts, sites)
    by_site: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, site in sites.items():
        mine = {p: parts[p] for p in site.parts if p in parts}
        if mine:
            by_site[key] = site_slot_values(site, mine, max_rank)
    return LoraAdapter(name, rank, scaling, by_site, tuple(targets))


def _number(name: str, config: dict, key: str, default: float) -> float:
    """`config[key]` as a finite float (JSON as Python reads it accepts NaN and Infinity)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"LoRA adapter {name!r}: {key}={value!r} in adapter_config.json is not a finite number"
        )
    return float(value)


def _check_values(name: str, parts: dict[str, tuple[np.ndarray, np.ndarray]], slot_dtype: np.dtype) -> None:
    """Every value finite and, once cast to the slots' dtype, still finite."""
    limit = float(np.finfo(slot_dtype).max) if np.issubdtype(slot_dtype, np.floating) else math.inf
    if slot_dtype.name == "bfloat16":
        import ml_dtypes

        limit = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    for module, (a, b) in parts.items():
        for which, value in (("lora_A", a), ("lora_B", b)):
            if not np.isfinite(value).all():
                raise ValueError(
                    f"LoRA adapter {name!r}: {module}.{which} holds NaN or infinite values (scaled by "
                    "lora_alpha / r for lora_B); retrain or repair the adapter"
                )
            peak = float(np.abs(value).max(initial=0.0))
            if peak > limit:
                raise ValueError(
                    f"LoRA adapter {name!r}: {module}.{which} holds {peak:.3g} (scaled by lora_alpha / r "
                    f"for lora_B), beyond the {slot_dtype.name} LoRA slots' range ({limit:.3g}); "
                    "rescale the adapter or start the engine with a wider lora_dtype"
                )


def _adapter_config(name: str, path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(
            f"LoRA adapter {name!r}: no adapter_config.json in {path!r} (a PEFT adapter directory)"
        )
    with open(file) as f:
        config = json.load(f)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported; only LORA is")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise ValueError(f"LoRA adapter {name!r}: {what} are not supported; retrain without {option}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported; use bias='none'")
    return config


def _adapter_tensors(name: str, path: str) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401  (NumPy learns bfloat16, PEFT's usual dtype, from it)
    from safetensors.numpy import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(
            f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r} (save the adapter with "
            "safe_serialization=True)"
        )
    try:
        return load_file(file)
    except Exception as error:  # a truncated or foreign file: safetensors' own error names it
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file!r}: {error}") from error


def _parts(
    name: str, tensors: dict[str, np.ndarray], sites: dict[str, LoraSite], max_rank: int, scaling: float
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{hf_module: (A [in, r], B * scaling [r, out])}` of every module the tensors adapt."""
    widths = {
        part: (site.in_features, site.adapter_width(i))
        for site in sites.values()
        for i, part in enumerate(site.parts)
    }
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a module; supported "
                f"target modules: {', '.join(SUPPORTED_TARGETS)}"
            )
        module = match["module"]
        if module not in widths:
            short = module.rsplit(".", 1)[-1]
            why = "cannot carry an adapter" if short not in SUPPORTED_TARGETS else "is not in this model"
            raise ValueError(
                f"LoRA adapter {name!r}: target module {module!r} {why}; supported target modules: "
                f"{', '.join(SUPPORTED_TARGETS)} (of dense decoder layers)"
            )
        found.setdefault(module, {})[match["which"]] = value
    parts = {}
    for module, pair in found.items():
        for which in "AB":
            if which not in pair:
                raise ValueError(
                    f"LoRA adapter {name!r}: missing tensor base_model.model.{module}.lora_{which}.weight"
                )
        a, b = pair["A"], pair["B"]  # [r, in], [out, r]
        in_features, out_features = widths[module]
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: {module} has rank {r} > max_lora_rank={max_rank}")
        if a.shape != (r, in_features) or b.shape != (out_features, r):
            raise ValueError(
                f"LoRA adapter {name!r}: {module} has lora_A {a.shape} and lora_B {b.shape}; this model "
                f"needs ({r}, {in_features}) and ({out_features}, {r}) (an adapter for another base model?)"
            )
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite values are refused after
            parts[module] = (
                a.T.astype(np.float32),
                (b.T.astype(np.float64) * scaling).astype(np.float32),
            )
    return parts


def _check_targets(name: str, config: dict, parts: dict, sites: dict[str, LoraSite]) -> None:
    """Every module `target_modules` names (a list of names; a regex string is matched against the
    full paths) in every layer `layers_to_transform` allows must have its tensors."""
    targets = config.get("target_modules") or []
    pattern = None
    if isinstance(targets, str):
        try:
            pattern = compile_target_pattern(targets)
        except PatternError as error:
            raise ValueError(f"LoRA adapter {name!r}: {error}") from None
    elif isinstance(targets, list):
        unsupported = sorted(set(targets) - set(SUPPORTED_TARGETS))
        if unsupported:
            raise ValueError(
                f"LoRA adapter {name!r}: target modules {unsupported} are not supported; supported: "
                f"{', '.join(SUPPORTED_TARGETS)}"
            )
    layers = config.get("layers_to_transform")
    layers = {layers} if isinstance(layers, int) else set(layers) if layers else None
    for site in sites.values():
        for module in site.parts:
            short = module.rsplit(".", 1)[1]
            if pattern is not None:
                wanted = pattern.fullmatch(module)
            else:
                wanted = short in targets
            layer = re.search(r"\.layers\.(\d+)\.", module)
            if layers is not None and layer is not None and int(layer[1]) not in layers:
                wanted = False
            if wanted and module not in parts:
                raise ValueError(
                    f"LoRA adapter {name!r}: target module {short!r} has no tensors for {module} "
                    f"(missing tensor base_model.model.{module}.lora_A.weight)"
                )
