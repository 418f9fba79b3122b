# SPDX-License-Identifier: Apache-2.0
"""How much of online fp8's perplexity cost on the tests' text is the layout, and how much the
luck of the rounding: the embedded model's dequantized float weights (as `perplexity.py` makes
them) in transformers, every attention and MLP projection rounded to e4m3 with one scale per
output channel (the served layout), one per tensor (vLLM's `fp8_per_tensor`), and per channel
with every scale a little larger (as precise, other roundings), against int8 per channel; the
LM head and the embedding stay in bfloat16 in each, as served. Reported: each one's perplexity
ratio to bfloat16 and its projections' relative squared weight error.

    .venv/bin/python benchmarks/fp8_rounding.py [--out benchmarks/results/fp8_rounding.json] [--draws N]

Not the served path (`perplexity.py` is): float32 arithmetic on bfloat16 weights, so that only
the weights' rounding differs between the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile

import ml_dtypes
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.perplexity import TEXT, float_copy  # noqa: E402

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _fp8(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return np.clip(w / scale, -448, 448).astype(FP8).astype(np.float32) * scale


def _int8(w: np.ndarray) -> np.ndarray:
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    return np.clip(np.round(w / scale), -127, 127) * scale


# name -> weight `[out, in]` (HF orientation) -> its rounded copy
ROUNDINGS = {
    "int8_per_channel": _int8,
    "fp8_per_channel": lambda w: _fp8(w, np.abs(w).max(axis=1, keepdims=True) / 448),
    "fp8_per_tensor": lambda w: _fp8(w, np.abs(w).max() / 448),
    "fp8_per_channel_scales_x1.01": lambda w: _fp8(w, np.abs(w).max(axis=1, keepdims=True) / 448 / 0.99),
    "fp8_per_channel_scales_x1.03": lambda w: _fp8(w, np.abs(w).max(axis=1, keepdims=True) / 448 / 0.97),
}


def _draws(perplexity, reference: float, count: int) -> dict:
    """Per-channel fp8 with every scale times 2^(j/count), j < count: equally precise layouts whose
    values fall on other points of e4m3's grid (the largest still within 224-448), so the spread
    of their perplexity is the rounding's luck and their mean what fp8 costs this model."""
    ratios = []
    for j in range(count):
        factor = 2 ** (j / count)
        value, _ = perplexity(lambda w, f=factor: _fp8(w, np.abs(w).max(axis=1, keepdims=True) / 448 * f))
        ratios.append(value / reference)
    mean = float(np.mean(ratios))
    return {"draws": count, "ratios": ratios, "mean": mean, "range": [min(ratios), max(ratios)]}


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plugin_shim.model_dir import materialize
    from tpu_platform.envs import read_env

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(HERE / "results" / "fp8_rounding.json"))
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument(
        "--draws", type=int, default=0, help="also N per-channel roundings, scales x 2^(j/N) (0: none)"
    )
    args = parser.parse_args()
    model_dir = float_copy(materialize(read_env().cache_dir), tempfile.mkdtemp(prefix="fp8-rounding-"))
    ids = torch.tensor(
        [AutoTokenizer.from_pretrained(model_dir)(TEXT.read_text())["input_ids"][: args.tokens]]
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = {n: p.detach().to(torch.bfloat16).float().numpy().copy() for n, p in model.named_parameters()}
    projections = [n for n in weights if n.endswith("proj.weight")]

    def perplexity(round_weight) -> tuple[float, float]:
        error = total = 0.0
        with torch.no_grad():
            for name, param in model.named_parameters():
                value = weights[name]
                if round_weight and name in projections:
                    rounded = round_weight(value)
                    error += float(((rounded - value) ** 2).sum())
                    total += float((value**2).sum())
                    value = rounded
                param.copy_(torch.from_numpy(np.ascontiguousarray(value, np.float32)))
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])
        return math.exp(-logp.mean().item()), error / total if total else 0.0

    reference, _ = perplexity(None)
    results = {"bfloat16": {"perplexity": reference}}
    for name, round_weight in ROUNDINGS.items():
        value, error = perplexity(round_weight)
        results[name] = {"perplexity": value, "ratio_to_bfloat16": value / reference, "weight_error": error}
        print(name, json.dumps(results[name]), flush=True)
    if args.draws:
        results["fp8_per_channel_draws"] = _draws(perplexity, reference, args.draws)
        print("fp8_per_channel_draws", json.dumps(results["fp8_per_channel_draws"]), flush=True)
    report = {"benchmark": "fp8_rounding", "text": "tests/data/alice.txt", "tokens": int(ids.shape[1])}
    pathlib.Path(args.out).write_text(json.dumps(report | {"results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
