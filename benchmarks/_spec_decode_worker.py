# SPDX-License-Identifier: Apache-2.0
"""One configuration of `spec_decode.py`, served in its own process: vLLM's `LLM` in-process on
our platform, the workloads' prompts, and a loop that runs the workload each line of stdin names
and prints its figures (`RESULT <json>`), so that the script can interleave configurations.

    python benchmarks/_spec_decode_worker.py CONFIG JSON_OPTIONS   (started by spec_decode.py)
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

WORKLOADS = ("single", "batch", "queue")
PER_BATCH = "_per_batch"  # a method's configuration with `--per-batch-size`
TINY = ("draft_model", "eagle", "eagle3")  # methods benchmarked on tiny random models

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


def speculative_config(config: str, options: dict) -> dict | None:
    """vLLM's `speculative_config` of a configuration (`off`, a method, `<method>_per_batch`)."""
    method = config.removesuffix(PER_BATCH)
    if method == "off":
        return None
    spec = {"method": method, "num_speculative_tokens": options["k"]}
    if method == "ngram":
        spec.update(prompt_lookup_min=options["min_n"], prompt_lookup_max=options["max_n"])
    else:
        spec["model"] = options["draft"]
    if config.endswith(PER_BATCH):
        spec["num_speculative_tokens_per_batch_size"] = per_batch_size(options["per_batch_size"])
    return spec


def _run(llm, workload: str, ids: list[list[int]], params) -> list:
    """`single`: the prompts one after another (one stream); `batch`, `queue`: all in one
    `generate` (at most `max_num_seqs` of them running at once)."""
    from vllm.inputs import TokensPrompt

    if workload == "single":
        return [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0] for p in ids]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)


def serve(config: str, options: dict) -> None:
    """Starts the engine, runs every prompt once (each step shape's program has then run before
    the timing), prints `READY`, then runs one workload a stdin line; `stats` prints the compile
    count after warm-up."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=options["model"], dtype=options["dtype"], max_model_len=1024,
        max_num_seqs=options["batch"], max_num_batched_tokens=1024, seed=0, disable_log_stats=False,
        speculative_config=speculative_config(config, options),
    )  # fmt: skip
    startup = time.perf_counter() - start
    tiny = options["method"] in TINY
    count = max(options["batch"], options["queue"])
    ids = random_prompts(count) if tiny else prompts(llm.get_tokenizer(), count)
    sizes = {"single": options["single"], "batch": options["batch"], "queue": options["queue"]}
    params = SamplingParams(temperature=0.0, max_tokens=options["tokens"], ignore_eos=tiny)
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in ids], SamplingParams(max_tokens=8), use_tqdm=False
    )
    print("READY " + json.dumps({"startup_s": startup}), flush=True)
    for line in sys.stdin:
        workload = line.strip()
        if workload == "stats":
            stats = llm.collective_rpc("runner_stats")[0]
            print(
                "RESULT " + json.dumps({"compiles_after_warmup": stats["compiles_after_warmup"]}), flush=True
            )
            continue
        before = _spec_metrics(llm)
        start = time.perf_counter()
        done = _run(llm, workload, ids[: sizes[workload]], params)
        wall = time.perf_counter() - start
        outputs = [list(o.outputs[0].token_ids) for o in done]
        result = {
            "wall_s": wall, "output_tokens": sum(map(len, outputs)), "outputs": outputs,
            "spec": _delta(_spec_metrics(llm), before),
            "sample_text": llm.get_tokenizer().decode(outputs[0]),
        }  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the plugin's packages
    serve(sys.argv[1], json.loads(sys.argv[2]))
