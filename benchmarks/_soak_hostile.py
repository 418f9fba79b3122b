# SPDX-License-Identifier: Apache-2.0
"""The LoRA traffic and the hostile phase of `soak.py`.

LoRA traffic: `ADAPTERS` random adapters (more than the server's `--max-loras` and
`--max-cpu-loras`, so device slots and the CPU cache both evict) are loaded and unloaded through
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` while clients send completions naming the
loaded ones (a request may race an unload and get a 404: counted apart, not as a failure).

Hostile phase, after the mixed traffic, each step with its expected outcome: a `logit_bias` of
5000 entries (refused, 4xx), `prompt_logprobs` cycling 0..5 (served, with that many per
position), an adapter holding a NaN (refused at load with its reason: vLLM's server answers every failed
load with a 500 carrying it), an adapter whose `target_modules` is a catastrophically
backtracking regular expression (matched in linear time: served, or refused, within the step's
timeout).
Between steps a greedy probe of the base model must answer, with the text it gave first: no
adapter or request may stop or poison the engine. The regex step comes last: a matcher that
backtracks would hang the engine there, and the probes after it say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

from lora import write_adapters

ADAPTERS = 4
RANK = 8
LORA_SERVER_ARGS = ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", str(RANK)]
# Backtracks for ever on a module name it does not match (nested quantifiers over the same text).
CATASTROPHIC_TARGETS = r"(\w+\.?)*\.x_proj$"
# What our refusal of the NaN adapter says (models/lora_files.py), found in the server's answer.
NAN_REFUSAL = "holds NaN or infinite values"
PROBE = {"prompt": "The river runs to the sea and", "max_tokens": 12, "temperature": 0.0}


def write_lora_adapters(model_dir: str, root: str) -> dict[str, str]:
    """Adapter name -> directory of `ADAPTERS` random adapters on every projection."""
    paths = write_adapters(model_dir, os.path.join(root, "lora"), ADAPTERS, RANK)
    return {f"soak-lora-{k}": path for k, path in enumerate(paths)}


def write_hostile_adapters(model_dir: str, root: str) -> dict[str, str]:
    """`nan`: an adapter with one NaN weight; `regex`: one whose `target_modules` is
    `CATASTROPHIC_TARGETS`."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    nan, regex = write_adapters(model_dir, os.path.join(root, "hostile"), 2, RANK)
    weights = os.path.join(nan, "adapter_model.safetensors")
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first][0, 0] = np.nan
    save_file(tensors, weights)
    config_path = os.path.join(regex, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["target_modules"] = CATASTROPHIC_TARGETS
    with open(config_path, "w") as f:
        json.dump(config, f)
    return {"nan": nan, "regex": regex}


class LoraTraffic:
    """Which adapters are loaded, and the loop that loads and unloads them."""

    def __init__(self, paths: dict[str, str]):
        self.paths = paths
        self.loaded: list[str] = []

    def pick(self, rng: random.Random) -> str | None:
        return rng.choice(self.loaded) if self.loaded else None

    async def cycle(self, session, base: str, tally, deadline: float, every: float, seed: int) -> None:
        """Until `deadline`: every `every` seconds load an adapter that is not loaded, and unload
        one when more than two are (so requests meet loads, unloads and evictions)."""
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            name = rng.choice([n for n in self.paths if n not in self.loaded])
            status = await _post(
                session, f"{base}/v1/load_lora_adapter", {"lora_name": name, "lora_path": self.paths[name]}
            )
            tally.add("lora_admin:load", status)
            if status == "200":
                self.loaded.append(name)
            if len(self.loaded) > 2:
                gone = self.loaded.pop(rng.randrange(len(self.loaded)))
                status = await _post(session, f"{base}/v1/unload_lora_adapter", {"lora_name": gone})
                tally.add("lora_admin:unload", status)
            await asyncio.sleep(every)


async def _post(session, url: str, body: dict[str, Any], timeout: float | None = None) -> str:
    """The HTTP status of a POST, or the name of the error that stopped it."""
    return (await _post_answer(session, url, body, timeout))[0]


async def _post_answer(
    session, url: str, body: dict[str, Any], timeout: float | None = None
) -> tuple[str, str]:
    """The HTTP status of a POST (or the name of the error that stopped it) and its body."""
    import aiohttp

    try:
        kwargs = {} if timeout is None else {"timeout": aiohttp.ClientTimeout(total=timeout)}
        async with session.post(url, json=body, **kwargs) as response:
            return str(response.status), (await response.read()).decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError) as error:
        return type(error).__name__, ""


async def _complete(session, base: str, body: dict[str, Any], timeout: float) -> tuple[str, dict | None]:
    import aiohttp

    try:
        async with session.post(
            f"{base}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            payload = await response.json(content_type=None)
            return str(response.status), payload if response.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        return type(error).__name__, None


async def probe(session, base: str, model: str, timeout: float) -> str | None:
    """The base model's greedy text for `PROBE`, or None when the engine does not answer."""
    status, payload = await _complete(session, base, {"model": model, **PROBE}, timeout)
    return payload["choices"][0]["text"] if status == "200" else None


def _prompt_logprobs_ok(payload: dict | None, n: int) -> bool:
    """Every prompt position after the first has the prompt token and the top `n`."""
    if payload is None:
        return False
    positions = payload["choices"][0].get("prompt_logprobs") or []
    return len(positions) > 1 and positions[0] is None and all(n <= len(p) <= n + 1 for p in positions[1:])


async def hostile_phase(
    session, base: str, model: str, adapters: dict[str, str], *, rounds: int, timeout: float
) -> dict[str, Any]:
    """Runs the hostile steps; returns each with its outcome and whether it was the expected one,
    and whether the base model's probe answered the same text after every step."""
    steps: list[dict[str, Any]] = []
    first = await probe(session, base, model, timeout)
    probes = []

    async def step(name: str, expected: str, run: Callable) -> None:
        started = time.monotonic()
        outcome, ok = await run()
        text = await probe(session, base, model, timeout)
        probes.append(text)
        steps.append(
            {
                "step": name, "expected": expected, "outcome": outcome, "ok": ok,
                "seconds": round(time.monotonic() - started, 2), "probe_after_unchanged": text == first,
            }
        )  # fmt: skip

    async def huge_logit_bias():
        body = {
            "model": model,
            "prompt": "hello",
            "max_tokens": 4,
            "logit_bias": {str(t): -1.0 for t in range(5000)},
        }
        status, _ = await _complete(session, base, body, timeout)
        return status, status.startswith("4")

    async def prompt_logprobs(n: int):
        body = {"model": model, "prompt": "the old road north", "max_tokens": 2, "prompt_logprobs": n}
        status, payload = await _complete(session, base, body, timeout)
        return status, status == "200" and _prompt_logprobs_ok(payload, n)

    def load(name: str, refusal: str | None):
        """Loads adapter `name`. Where `refusal` is given the load must be refused with that text:
        a 4xx, or the 500 that vLLM's server answers for every failed load but a missing adapter
        (its `load_lora_adapter`), carrying our reason; the engine lives on (the probe checks).
        Else the load may be served or refused, promptly."""

        async def run():
            status, answer = await _post_answer(
                session,
                f"{base}/v1/load_lora_adapter",
                {"lora_name": f"hostile-{name}", "lora_path": adapters[name]},
                timeout,
            )
            if status == "200":  # accepted: used once, then taken away (the probe shows any harm left)
                await _complete(session, base, {"model": f"hostile-{name}", **PROBE}, timeout)
                await _post(
                    session, f"{base}/v1/unload_lora_adapter", {"lora_name": f"hostile-{name}"}, timeout
                )
            named = refusal is not None and refusal in answer
            refused = status.startswith("4") or (status == "500" and named)
            outcome = "refused" if refused else status
            return outcome, refused if refusal is not None else (status == "200" or refused)

        return run

    await step("logit_bias_5000", "4xx", huge_logit_bias)
    for n in [n for _ in range(rounds) for n in range(6)]:
        await step(f"prompt_logprobs_{n}", "200", lambda n=n: prompt_logprobs(n))
    if adapters:  # a server with LoRA enabled
        await step("nan_adapter", "refused", load("nan", NAN_REFUSAL))
        # Matched in linear time: served, or refused by name, but never a stalled engine.
        await step("regex_adapter", "200 or refused", load("regex", None))
    return {
        "steps": steps,
        "first_probe": first,
        "all_expected": all(s["ok"] for s in steps),
        "base_output_unchanged": first is not None and all(p == first for p in probes),
    }
