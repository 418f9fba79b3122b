# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding against none, in one run, configurations interleaved.

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
`--aux-layers`; the figures show the head's costs per step, not an EAGLE-3 speed-up. `--method
eagle`: an EAGLE-1 head (vLLM's `EagleLlamaForCausalLM`, random weights, the target's embedding
and LM head) reading the same target's final hidden states; the same caveat.

    .venv/bin/python benchmarks/spec_decode.py [--method ngram|draft_model|eagle|eagle3] [--out FILE]
        [--dtype auto] [--tokens 128] [--k 4] [--min-n 2] [--max-n 4] [--batch 16] [--queue 48]
        [--single 12] [--repeats 5] [--per-batch-size "1-4:4,5-64:1"]

`--per-batch-size` adds a configuration (`<method>_per_batch`): the method with vLLM's
`num_speculative_tokens_per_batch_size` schedule, `first-last:k` ranges of the step's batch size
(k capped at `--k`), run beside fixed k.

Each configuration (no speculation; the method with k drafts; the schedule) is served by its own
process (`_spec_decode_worker.py`: vLLM's `LLM` in-process, greedy chat prompts, `ignore_eos` off:
each stops at its end of turn or `--tokens`), all started first, then told one workload at a time:
`--repeats` rounds, each running every workload on every configuration in turn (the order rotated
each round), so that the machine's drift between minutes falls on all of them alike. Workloads:
`single`, `--single` prompts one after another (one stream); `batch`, `--batch` prompts in one
`generate` call (`max_num_seqs = --batch`: they start together and finish at their own lengths);
`queue`, `--queue` prompts in one call (`--batch` of them running at once until the queue drains).
Reported per workload: output tokens/s at the median wall time, the ratio to no speculation (the
median and range of each round's ratio); the draft acceptance rate (accepted / drafted tokens) and
the mean acceptance length (1 + accepted tokens per drafting step of a request) from vLLM's
spec-decode metrics; how many requests' greedy outputs differ from those without speculation, and
the control: how many differ without speculation between running alone and in the batch (16-bit
activations round differently in steps of other shapes); compiles after warm-up.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _spec_decode_worker import PER_BATCH, WORKLOADS, per_batch_size  # noqa: E402

CONFIGS = ("off", "ngram", "draft_model", "eagle", "eagle3")
WORKER = HERE / "_spec_decode_worker.py"


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


def _differing(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """How many requests' greedy tokens differ from the reference's."""
    return sum(a != b for a, b in zip(outputs, reference, strict=True))


class _Worker:
    """A configuration's process: started (it warms up, then says `READY`), then told which
    workload to run, one at a time. Its log goes to `log`."""

    def __init__(self, config: str, options: dict, log):
        self.config, self.log = config, log.name
        command = [sys.executable, str(WORKER), config, json.dumps(options)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        self.startup = self._read("READY ")["startup_s"]

    def _read(self, prefix: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(prefix):
                return json.loads(line.removeprefix(prefix))
        raise RuntimeError(f"{self.config} exited with {self.process.wait()}; see {self.log}")

    def run(self, workload: str) -> dict:
        self.process.stdin.write(workload + "\n")
        self.process.stdin.flush()
        return self._read("RESULT ")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _start(configs: tuple[str, ...], options: dict, log_dir: str) -> dict[str, _Worker]:
    """Each configuration's worker, started one after another (a failing one is reported and left
    out)."""
    workers = {}
    for config in configs:
        try:
            with open(os.path.join(log_dir, f"{config}.log"), "w") as log:
                workers[config] = _Worker(config, options, log)
        except RuntimeError as error:
            print(f"{config} failed: {error}", flush=True)
    return workers


def _rounds(workers: dict[str, _Worker], workloads: list[str], repeats: int) -> dict:
    """`runs[config][workload]`: each round's result, the configurations' order rotated a round."""
    runs: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    names = list(workers)
    for r in range(repeats):
        for workload in workloads:
            for config in names[r % len(names) :] + names[: r % len(names)]:
                runs[config][workload].append(workers[config].run(workload))
        print(f"round {r + 1}/{repeats} done", flush=True)
    return runs


def _figures(runs: list[dict], off_runs: list[dict] | None) -> dict:
    """A workload's figures for one configuration from its rounds (and no speculation's)."""
    walls = [run["wall_s"] for run in runs]
    tokens = runs[0]["output_tokens"]
    spec: dict[str, float] = collections.Counter()
    for run in runs:
        spec.update(run["spec"])
    figures = {
        "requests": len(runs[0]["outputs"]), "output_tokens": tokens, "walls_s": walls,
        "wall_s": statistics.median(walls), "output_tokens_per_s": tokens / statistics.median(walls),
        "outputs_same_each_round": all(run["outputs"] == runs[0]["outputs"] for run in runs),
        **_acceptance(spec),
    }  # fmt: skip
    if off_runs:
        ratios = [
            (run["output_tokens"] / run["wall_s"]) / (off["output_tokens"] / off["wall_s"])
            for run, off in zip(runs, off_runs, strict=True)
        ]
        figures.update(speedup=statistics.median(ratios), speedup_range=[min(ratios), max(ratios)])
    return figures


def _row(config: str, workload: str, w: dict | None) -> str:
    """A line of the printed table (its header when `w` is None)."""
    if w is None:
        columns = f"{'out tok/s':>10} {'vs off':>7} {'range':>11} {'accept':>7} {'mean len':>8}"
        return f"{config:<16} {workload:<8} {columns}"
    nan = float("nan")
    low, high = w.get("speedup_range", (nan, nan))
    rate, length = w["acceptance_rate"] or nan, w["mean_acceptance_length"] or nan
    return (
        f"{config:<16} {workload:<8} {w['output_tokens_per_s']:>10.1f} {w.get('speedup', nan):>7.2f} "
        f"{low:>5.2f}-{high:<5.2f} {rate:>7.2f} {length:>8.2f}"
    )


def _summarize(runs: dict, configs: tuple[str, ...], method: str) -> tuple[dict, list[dict]]:
    """Prints each configuration's figures; returns the summary (each workload's median speed-up
    over no speculation, requests whose greedy outputs differ from its, the control) and the
    per-configuration results."""
    off = runs.get("off")
    results, summary = [], {}
    print(_row("config", "workload", None))
    for config in (c for c in configs if c in runs):
        result = {"config": config}
        prefix = "" if config == method else f"{config}_"  # the fixed k's keys as before
        for workload, workload_runs in runs[config].items():
            off_runs = off[workload] if off else None
            w = result[workload] = _figures(workload_runs, off_runs)
            print(_row(config, workload, w))
            summary[f"{config}_{workload}_speedup"] = w.get("speedup")
            if off and config != "off":
                summary[f"{config}_{workload}_speedup_range"] = w["speedup_range"]
                differing = _differing(workload_runs[0]["outputs"], off_runs[0]["outputs"])
                summary[f"{prefix}{workload}_outputs_identical"] = not differing
                summary[f"{prefix}{workload}_outputs_differing"] = differing
        result["sample_text"] = runs[config]["batch"][0]["sample_text"]
        results.append(result)
    if off:
        # The control: without speculation, do the same prompts' greedy outputs depend on the
        # step's shape (alone or among others)? Rounding in 16-bit activations can flip a near-tie.
        single = off["single"][0]["outputs"]
        batch = off["batch"][0]["outputs"][: len(single)]
        summary["off_single_vs_batch_differing"] = _differing(single, batch)
    return summary, results


def _models(args: argparse.Namespace) -> tuple[str, str]:
    """(target, draft) directories: the embedded model's (no draft), or tiny ones built here."""
    if args.method == "draft_model":
        root = tempfile.mkdtemp(prefix="spec_decode_")
        return tiny_models(root, args.target_layers, args.draft_layers)
    if args.method == "eagle3":
        from tests.tiny_models import save_tiny_eagle3_head

        root = tempfile.mkdtemp(prefix="spec_decode_")
        model, _ = tiny_models(root, args.target_layers, args.target_layers)
        layers = tuple(int(i) for i in args.aux_layers.split(","))
        return model, save_tiny_eagle3_head(os.path.join(root, "head"), model, seed=6, aux_layer_ids=layers)
    if args.method == "eagle":
        from tests.tiny_models import save_tiny_eagle_head

        root = tempfile.mkdtemp(prefix="spec_decode_")
        model, _ = tiny_models(root, args.target_layers, args.target_layers)
        return model, save_tiny_eagle_head(os.path.join(root, "head"), model, seed=6)
    from _peers import gguf_model_dir

    return gguf_model_dir(), ""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--method", choices=CONFIGS[1:], default="ngram")
    parser.add_argument("--out", help="default: benchmarks/results/spec_decode[_<method>].json")
    parser.add_argument("--target-layers", type=int, default=6, help="draft_model: the target's layers")
    parser.add_argument(
        "--draft-layers", type=int, default=1, help="draft_model: the draft's (the target's first ones)"
    )
    parser.add_argument(
        "--aux-layers", default="1,3,5", help="eagle3: the target layers the head reads (comma-separated)"
    )
    parser.add_argument(
        "--dtype", default="auto", help="the model's dtype (auto: its config's; the embedded model's float32)"
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument(
        "--batch", type=int, default=16, help="prompts of the batch workload, and max_num_seqs"
    )
    parser.add_argument("--queue", type=int, default=48, help="prompts of the queue workload (0: none)")
    parser.add_argument("--single", type=int, default=12, help="prompts run one after another")
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds of every workload on every configuration"
    )
    parser.add_argument(
        "--per-batch-size", help='a k schedule by batch size beside fixed k, e.g. "1-4:4,5-64:1"'
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.per_batch_size:
        per_batch_size(args.per_batch_size)  # refused here, before any engine starts
    suffix = "" if args.method == "ngram" else f"_{args.method}"
    args.out = args.out or str(HERE / "results" / f"spec_decode{suffix}.json")
    os.environ.setdefault("VLLM_XLA_PLATFORM", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, draft = _models(args)
    configs = ("off", args.method) + ((args.method + PER_BATCH,) if args.per_batch_size else ())
    options = dict(vars(args), model=model, draft=draft)
    log_dir = tempfile.mkdtemp(prefix="spec_decode_logs_")
    workers = _start(configs, options, log_dir)
    if "off" not in workers:
        raise SystemExit(f"no speculation's engine did not start; see {log_dir}")
    workloads = list(WORKLOADS if args.queue else WORKLOADS[:2])
    load_before = os.getloadavg()  # the workers started: their own start-up is not the machine's load
    try:
        runs = _rounds(workers, workloads, args.repeats)
        compiles = {
            config: worker.run("stats")["compiles_after_warmup"] for config, worker in workers.items()
        }
    finally:
        for worker in workers.values():
            worker.close()
    summary, results = _summarize(runs, configs, args.method)
    for result in results:
        result.update(
            startup_s=workers[result["config"]].startup, compiles_after_warmup=compiles[result["config"]]
        )
    print(f"summary: {summary}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        # Paths as the repository names them (the tiny models' temporary directory is not kept).
        recorded = dict(vars(args), out=os.path.relpath(args.out, HERE.parent))
        machine = {"cpus": os.cpu_count(), "load_average_before_after": [load_before, os.getloadavg()]}
        json.dump({"args": recorded, "machine": machine, "summary": summary, "results": results}, f, indent=1)
    print(f"wrote {args.out} (workers' logs in {log_dir})")


if __name__ == "__main__":
    main()
