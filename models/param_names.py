# SPDX-License-Identifier: Apache-2.0
"""A model's `hf_param_map` (HF names with `{i}` layer and `{e}` expert fields -> our parameter
paths) as regular expressions, and the lookup of one checkpoint name."""

from __future__ import annotations

import re


def compile_param_map(hf_param_map: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile(hf_pattern(hf) + "$"), ours) for hf, ours in hf_param_map.items()]


def hf_pattern(hf: str) -> str:
    """The regular expression of an HF name with `{i}` (layer) and `{e}` (expert) fields."""
    pattern = re.escape(hf)
    for key in ("i", "e"):
        pattern = pattern.replace(re.escape(f"{{{key}}}"), rf"(?P<{key}>\d+)")
    return pattern


def our_name(hf: str, compiled: list[tuple[re.Pattern[str], str]]) -> tuple[str, int | None] | None:
    """Our parameter path for `hf`, and the expert slot it fills (None: the whole parameter)."""
    for pattern, ours in compiled:
        match = pattern.match(hf)
        if match:
            groups = match.groupdict()
            if "i" in groups:
                ours = ours.replace("{i}", groups["i"])
            return ours, int(groups["e"]) if "e" in groups else None
    return None
