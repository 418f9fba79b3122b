# SPDX-License-Identifier: Apache-2.0
"""The requests `soak.py` sends: valid completions and chats of random length with random
sampling options, streamed or not (`valid_request`), and malformed ones the server must refuse
with a 4xx (`invalid_request`)."""

from __future__ import annotations

import json
import random
from typing import Any

MODEL_NAME = "soak"
WORDS = "the of a river mountain city light north sea old new quiet bright story road".split()


def random_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def sampling_options(rng: random.Random) -> dict[str, Any]:
    options: dict[str, Any] = {"max_tokens": rng.randint(1, 48)}
    if rng.random() < 0.4:
        options["temperature"] = 0.0
    else:
        options["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        options["top_p"] = rng.choice([1.0, 0.9, 0.5])
        options["top_k"] = rng.choice([-1, 1, 20, 50])
        if rng.random() < 0.3:
            options["min_p"] = rng.choice([0.05, 0.1])
    if rng.random() < 0.3:
        options["presence_penalty"] = rng.uniform(-1, 1)
        options["frequency_penalty"] = rng.uniform(-1, 1)
    if rng.random() < 0.2:
        options["repetition_penalty"] = rng.uniform(1.0, 1.5)
    if rng.random() < 0.3:
        options["seed"] = rng.randint(0, 2**31 - 1)
    if rng.random() < 0.15:
        options["stop"] = [rng.choice(WORDS)]
    return options


def invalid_request(rng: random.Random, max_model_len: int) -> tuple[str, str, bytes]:
    """(name, path, body) of a request the server must refuse with a 4xx."""
    valid = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
    kind = rng.choice(
        [
            "broken_json",
            "negative_max_tokens",
            "negative_temperature",
            "unknown_model",
            "prompt_too_long",
            "missing_prompt",
        ]
    )
    body: Any = dict(valid)
    if kind == "broken_json":
        return kind, "/v1/completions", b'{"model": "soak", "prompt": "hel'
    if kind == "negative_max_tokens":
        body["max_tokens"] = -3
    elif kind == "negative_temperature":
        body["temperature"] = -1.0
    elif kind == "unknown_model":
        body["model"] = "no-such-model"
    elif kind == "prompt_too_long":
        body["prompt"] = random_text(rng, 2 * max_model_len)
    else:
        del body["prompt"]
    return kind, "/v1/completions", json.dumps(body).encode()


def valid_request(rng: random.Random, max_model_len: int) -> tuple[str, str, dict[str, Any], bool]:
    """(kind, path, body, stream) of a request with random length, options and streaming."""
    options = sampling_options(rng)
    words = rng.randint(1, max(1, (max_model_len - options["max_tokens"]) // 3))
    stream = rng.random() < 0.5
    if rng.random() < 0.3:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": random_text(rng, words)}]}
        path, kind = "/v1/chat/completions", "chat"
    else:
        body = {"model": MODEL_NAME, "prompt": random_text(rng, words)}
        path, kind = "/v1/completions", "completion"
    body.update(options, stream=stream)
    return kind, path, body, stream
