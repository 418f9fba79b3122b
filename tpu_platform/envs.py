# SPDX-License-Identifier: Apache-2.0
"""Every `VLLM_XLA_*` environment knob, read here and nowhere else (documented in docs/configuration.md).

- VLLM_XLA_PLATFORM: activate the plugin for a device kind (tpu, gpu, cpu); unset: only on a TPU.
- VLLM_XLA_ATTENTION_BACKEND: auto, xla, pallas_tpu, pallas_gpu or cpu_native (default auto: by
  device kind; on CPU cpu_native when a C++ compiler can build it, else xla).
- VLLM_XLA_CPU_KV_CACHE_GB: KV cache size on CPU in GiB (default 1).
- VLLM_XLA_CACHE_DIR: embedded model, executable and JAX compilation caches, metrics files
  (default $XDG_CACHE_HOME/vllm-xla).
- VLLM_XLA_STRICT_COMPILE: 1 makes a compilation after warm-up an error (default 0).
- VLLM_XLA_CPU_ASYNC_SCHEDULING: 1 keeps vLLM's async scheduling on the CPU device (default 0:
  there it is turned off, as vLLM's own CPU backend does; see docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import os

# Every variable this module reads; any other `VLLM_XLA_*` name is a mistake (`unknown_variables`).
VARIABLES = (
    "VLLM_XLA_PLATFORM", "VLLM_XLA_ATTENTION_BACKEND", "VLLM_XLA_CPU_KV_CACHE_GB", "VLLM_XLA_CACHE_DIR",
    "VLLM_XLA_STRICT_COMPILE", "VLLM_XLA_CPU_ASYNC_SCHEDULING",
)  # fmt: skip
PREFIX = "VLLM_XLA_"
DEVICE_KINDS = ("tpu", "gpu", "cpu")
ATTENTION_BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "cpu_native")


@dataclasses.dataclass(frozen=True, slots=True)
class XlaEnv:
    platform: str | None
    attention_backend: str
    cpu_kv_cache_gb: float
    cache_dir: str
    strict_compile: bool
    cpu_async_scheduling: bool


def _choice(name: str, value: str | None, choices: tuple[str, ...]) -> str | None:
    if value is None or value == "":
        return None
    value = value.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; use one of {', '.join(choices)}")
    return value


def _float(name: str, value: str | None, default: float) -> float:
    if not value:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number (e.g. {name}=2 for 2 GiB)") from None
    if parsed <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return parsed


_TRUE, _FALSE = ("1", "true", "yes"), ("", "0", "false", "no")


def _flag(name: str, value: str | None) -> bool:
    parsed = (value or "").strip().lower()
    if parsed not in _TRUE + _FALSE:
        raise ValueError(f"{name}={value!r} is not valid; use 1 (on) or 0 (off)")
    return parsed in _TRUE


def default_cache_dir(environ: os._Environ[str] | dict[str, str]) -> str:
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "vllm-xla")


def unknown_variables(environ: os._Environ[str] | dict[str, str] | None = None) -> list[str]:
    """One message per `VLLM_XLA_*` variable set in `environ` that is not ours (a misspelt knob
    would otherwise be ignored), naming the nearest known one."""
    env = os.environ if environ is None else environ
    messages = []
    for name in sorted(n for n in env if n.startswith(PREFIX) and n not in VARIABLES):
        # Compared without the shared prefix, which would make every name look close.
        nearest = difflib.get_close_matches(name[len(PREFIX) :], [v[len(PREFIX) :] for v in VARIABLES], n=1)
        hint = f"did you mean {PREFIX}{nearest[0]}?" if nearest else f"known ones: {', '.join(VARIABLES)}"
        messages.append(f"unknown vllm-xla environment variable {name}: {hint}")
    return messages


def read_env(environ: os._Environ[str] | dict[str, str] | None = None) -> XlaEnv:
    """Parses the `VLLM_XLA_*` variables, failing with a message that names the bad one."""
    env = os.environ if environ is None else environ
    return XlaEnv(
        platform=_choice("VLLM_XLA_PLATFORM", env.get("VLLM_XLA_PLATFORM"), DEVICE_KINDS),
        attention_backend=_choice(
            "VLLM_XLA_ATTENTION_BACKEND", env.get("VLLM_XLA_ATTENTION_BACKEND"), ATTENTION_BACKENDS
        )
        or "auto",
        cpu_kv_cache_gb=_float("VLLM_XLA_CPU_KV_CACHE_GB", env.get("VLLM_XLA_CPU_KV_CACHE_GB"), 1.0),
        cache_dir=env.get("VLLM_XLA_CACHE_DIR") or default_cache_dir(env),
        strict_compile=_flag("VLLM_XLA_STRICT_COMPILE", env.get("VLLM_XLA_STRICT_COMPILE")),
        cpu_async_scheduling=_flag("VLLM_XLA_CPU_ASYNC_SCHEDULING", env.get("VLLM_XLA_CPU_ASYNC_SCHEDULING")),
    )
