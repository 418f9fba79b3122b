# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding against none, in one run.

`--method ngram` (default): n-gram drafts on an input-grounded workload, the embedded
SmolLM2-135M-Instruct asked to repeat, rewrite or edit a text it is given (outputs that copy spans
of the prompt, where prompt lookup finds its drafts).

`--method draft_model`: a draft model, on tiny random Llamas built here (no hub): a target of
`--target-layers` layers whose layers' outputs are scaled down, and a draft of its first
`--draft-layers` (with the embedding, norm and head; all of them: the target itself, whose
drafts are all accepted); prompts of random ids. Such a draft costs a large share of the target
(same width), so the figures show the mechanism's costs and acceptance, not the speed-up of a
draft far smaller than its target.

`--method eagle3`: an EAGLE-3 head (vLLM's `LlamaForCausalLMEagle3` layout, random weights: an
untrained head, whose drafts the target rarely keeps) for the same tiny target, reading its layers
`--aux-layers`; the figures show the head's costs per step, not an EAGLE-3 speed-up.

    .venv/bin/python benchmarks/spec_decode.py [--method ngram|draft_model|eagle3] [--out FILE]
        [--tokens 128] [--k 4] [--min-n 2] [--max-n 4] [--batch 16] [--per-batch-size "1-4:4,5-64:1"]

`--per-batch-size` adds a configuration (`<method>_per_batch`): the method with vLLM's
`num_speculative_tokens_per_batch_size` schedule, `first-last:k` ranges of the step's batch size
(k capped at `--k`), run beside fixed k.

Each configuration (no speculation; n-gram with k drafts) runs in its own subprocess (this script
with `--worker`): vLLM's `LLM` in-process, greedy chat prompts (`ignore_eos` off: each stops at its
end of turn or `--tokens`). Workloads: `single`, the prompts one after another (one stream), and
`batch`, `--batch` of them in one `generate` call. Reported: output tokens/s and its ratio to no
speculation; the draft acceptance rate (accepted / drafted tokens) and the mean acceptance length
(1 + accepted tokens per drafting step of a request, vLLM's definition) from vLLM's spec-decode
metrics; whether the greedy outputs equal those without speculation; compiles after warm-up. The
machine's noise applies: compare ratios from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CONFIGS = ("off", "ngram", "draft_model", "eagle3")
PER_BATCH = "_per_batch"  # a method's configuration with `--per-batch-size`
TINY = ("draft_model", "eagle3")  # methods benchmarked on tiny random models

_TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens and wrote the weather in a leather book: wind from the north-west, "
    "sea moderate, two fishing boats returning before dark.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. When "
    "the front light turns green, open the settings page, choose the network tab and enter the new "
    "password twice before saving.",
    "Our quarterly meeting is moved to Thursday at ten o'clock in the large conference room on the "
    "third floor. Please bring the budget summary, the hiring plan and your questions for the "
    "product team.",
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal "
    "+= item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n",
]
_ASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this text and fix any typos, changing nothing else:\n\n{}",
    "Rewrite the following text in the same words, as one paragraph:\n\n{}",
    "Here is some text. Write it out again, unchanged:\n\n{}",
]
_CODE_ASK = "Rename the variable `subtotal` to `net` in this function and show the whole function:\n\n{}"


def tiny_models(root: str, target_layers: int, draft_layers: int) -> tuple[str, str]:
    """A tiny random target and its draft of its first `draft_layers` layers (`--method
    draft_model`; all of them: the target itself, every draft accepted), saved under `root`."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.tiny_models import save_tiny_llama

    target = save_tiny_llama(
        os.path.join(root, "target"), seed=5, hidden_size=256, intermediate_size=512,
        num_hidden_layers=target_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
    model.save_pretrained(target, safe_serialization=True)
    if draft_layers >= target_layers:
        return target, target
    model.model.layers = model.model.layers[:draft_layers]
    model.config.num_hidden_layers = draft_layers
    draft = os.path.join(root, "draft")
    model.save_pretrained(draft, safe_serialization=True)
    return target, draft


def random_prompts(count: int, vocab: int = 384) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [[1, *rng.integers(3, vocab, int(rng.integers(20, 60))).tolist()] for _ in range(count)]


def prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts (token ids) asking to repeat, rewrite or edit a given text."""
    asks = [(a, t) for t in _TEXTS[:3] for a in _ASKS] + [(_CODE_ASK, _TEXTS[3]), (_ASKS[0], _TEXTS[3])]
    out = []
    for i in range(count):
        ask, text = asks[i % len(asks)]
        messages = [{"role": "user", "content": ask.format(text)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def per_batch_size(text: str) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` for "1-4:4,5-64:1"."""
    schedule = []
    for part in text.split(","):
        sizes, _, k = part.partition(":")
        first, _, last = sizes.partition("-")
        if not (k and first and last):
            raise ValueError(f"--per-batch-size takes first-last:k ranges, e.g. 1-4:4,5-64:1; got {part!r}")
        schedule.append([int(first), int(last), int(k)])
    return schedule


def _spec_metrics(llm) -> dict[str, float]:
    values = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            values[m.name.removeprefix("vllm:spec_decode_num_")] = m.value
    return values


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _acceptance(spec: dict[str, float]) -> dict[str, float | None]:
    drafts, drafted, accepted = (
        spec.get("drafts", 0),
        spec.get("draft_tokens", 0),
        spec.get("accepted_tokens", 0),
    )
    return {
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def worker(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(
        max_model_len=1024,
        max_num_seqs=args.batch,
        max_num_batched_tokens=1024,
        seed=0,
        disable_log_stats=False,
    )
    method = args.worker.removesuffix(PER_BATCH)
    if method == "ngram":
        engine["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.min_n,
            "prompt_lookup_max": args.max_n,
        }  # fmt: skip
    if method in TINY:
        engine["speculative_config"] = {
            "method": method, "model": args.draft, "num_speculative_tokens": args.k
        }  # fmt: skip
    if args.worker.endswith(PER_BATCH):
        engine["speculative_config"]["num_speculative_tokens_per_batch_size"] = per_batch_size(
            args.per_batch_size
        )
    start = time.perf_counter()
    llm = LLM(model=args.model, **engine)
    startup = time.perf_counter() - start
    tiny = args.method in TINY
    ids = random_prompts(args.batch) if tiny else prompts(llm.get_tokenizer(), args.batch)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=tiny)
    # Every prompt once first: each step shape's program has run before the timing (the first run
    # of a large program sets up its kernels).
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in ids], SamplingParams(max_tokens=8), use_tqdm=False
    )
    results, outputs = {"config": args.worker, "startup_s": startup}, {}
    for workload in ("single", "batch"):
        before = _spec_metrics(llm)
        start = time.perf_counter()
        if workload == "single":
            done = [
                llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
                for p in ids[: args.single]
            ]
        else:
            done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in done)
        outputs[workload] = [list(o.outputs[0].token_ids) for o in done]
        results[workload] = {
            "requests": len(done), "output_tokens": generated, "wall_s": wall,
            "output_tokens_per_s": generated / wall,
            **_acceptance(_delta(_spec_metrics(llm), before)),
        }  # fmt: skip
    stats = llm.collective_rpc("runner_stats")[0]
    results["compiles_after_warmup"] = stats["compiles_after_warmup"]
    results["outputs"] = outputs
    results["sample_text"] = llm.get_tokenizer().decode(outputs["batch"][0])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", choices=CONFIGS[1:], default="ngram")
    parser.add_argument("--out", help="default: benchmarks/results/spec_decode[_draft_model].json")
    parser.add_argument("--target-layers", type=int, default=6, help="draft_model: the target's layers")
    parser.add_argument(
        "--draft-layers", type=int, default=1, help="draft_model: the draft's (the target's first ones)"
    )
    parser.add_argument(
        "--aux-layers", default="1,3,5", help="eagle3: the target layers the head reads (comma-separated)"
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--single", type=int, default=4, help="prompts run one after another")
    parser.add_argument(
        "--per-batch-size", help='a k schedule by batch size beside fixed k, e.g. "1-4:4,5-64:1"'
    )
    parser.add_argument(
        "--worker", choices=(*CONFIGS, *(c + PER_BATCH for c in CONFIGS[1:])), help=argparse.SUPPRESS
    )
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--draft", help=argparse.SUPPRESS)
    args = parser.parse_args()
    suffix = "" if args.method == "ngram" else f"_{args.method}"
    args.out = args.out or str(HERE / "results" / f"spec_decode{suffix}.json")
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    from _peers import gguf_model_dir

    os.environ.setdefault("VLLM_XLA_PLATFORM", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.method == "draft_model":
        root = tempfile.mkdtemp(prefix="spec_decode_")
        model, draft = tiny_models(root, args.target_layers, args.draft_layers)
    elif args.method == "eagle3":
        from tests.tiny_models import save_tiny_eagle3_head

        root = tempfile.mkdtemp(prefix="spec_decode_")
        model, _ = tiny_models(root, args.target_layers, args.target_layers)
        layers = tuple(int(i) for i in args.aux_layers.split(","))
        draft = save_tiny_eagle3_head(os.path.join(root, "head"), model, seed=6, aux_layer_ids=layers)
    else:
        model, draft = gguf_model_dir(), ""
    results = []
    configs = ("off", args.method) + ((args.method + PER_BATCH,) if args.per_batch_size else ())
    for config in configs:
        command = [sys.executable, __file__, "--worker", config, "--model", model, "--draft", draft]
        if args.per_batch_size:
            command += ["--per-batch-size", args.per_batch_size]
        for name in ("method", "tokens", "k", "min_n", "max_n", "batch", "single"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{config} failed:\n{done.stderr[-3000:]}")
            continue
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print(f"{config}: done", flush=True)
    by_config = {r["config"]: r for r in results}
    off = by_config.get("off")
    summary = {}
    print(f"{'config':<16} {'workload':<8} {'out tok/s':>10} {'vs off':>7} {'accept':>7} {'mean len':>9}")
    for r in results:
        for workload in ("single", "batch"):
            w = r[workload]
            ratio = w["output_tokens_per_s"] / off[workload]["output_tokens_per_s"] if off else float("nan")
            nan = float("nan")
            rate, length = w["acceptance_rate"] or nan, w["mean_acceptance_length"] or nan
            print(
                f"{r['config']:<16} {workload:<8} {w['output_tokens_per_s']:>10.1f} {ratio:>7.2f} "
                f"{rate:>7.2f} {length:>9.2f}"
            )
            summary[f"{r['config']}_{workload}_speedup"] = ratio
    for config in configs[1:]:
        spec = by_config.get(config)
        if off and spec:
            prefix = "" if config == args.method else f"{config}_"  # the fixed k's keys as before
            for workload in ("single", "batch"):
                same = off["outputs"][workload] == spec["outputs"][workload]
                summary[f"{prefix}{workload}_outputs_identical"] = same
    print(f"summary: {summary}")
    for r in results:
        r.pop("outputs", None)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        # Paths as the repository names them (the tiny models' temporary directory is not kept).
        recorded = dict(vars(args), out=os.path.relpath(args.out, HERE.parent), model=None, draft=None)
        json.dump({"args": recorded, "summary": summary, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
