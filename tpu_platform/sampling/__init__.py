# SPDX-License-Identifier: Apache-2.0
"""The jitted sampler: every vLLM `SamplingParams` option in one pure JAX function.

Host side, `SamplingBatch` keeps each request's options by runner row and, per step, `prepare`
builds one `SamplingTensors` pytree (NumPy, leading dim = padded rows) and static `SamplerFlags`.
Device side, `sample(logits, tensors, flags=flags)` returns a `SamplerOutput`. New parameter values
never recompile; the programs are the few flag combinations (`warmup_flag_sets`) times the row
bucket, times the bucketed widths of the penalty window and sparse lists when those are on.
Seeded requests draw from a key that depends only on (seed, tokens generated so far).

Modules: `options` (SamplingOptions), `batch` + `host` (NumPy host state), `tensors` (flags and
pytrees), `ops` (bitmasks, bad words, min_tokens, bias, penalties, logprobs), `filters` (min-p and
sort-free top-k/top-p), `noise` (keys and the draw), `sampler` (`sample`), `reference` (a NumPy
reference of vLLM's sampler used by the tests; never imported by the package).

No vLLM and no torch here: pure JAX and NumPy.
"""

from tpu_platform.sampling.batch import SamplingBatch
from tpu_platform.sampling.host import TokenHistory, pack_token_bitmask
from tpu_platform.sampling.ops import apply_grammar_bitmask, compute_logprobs, gather_logprobs, greedy_sample
from tpu_platform.sampling.options import MAX_SPARSE_ENTRIES, SAMPLING_EPS, SamplingOptions
from tpu_platform.sampling.sampler import prompt_logprobs, sample
from tpu_platform.sampling.tensors import (
    EXTRA_FEATURES,
    LOGPROBS_MODES,
    SamplerFlags,
    SamplerOutput,
    SamplingTensors,
    dummy_tensors,
    warmup_flag_sets,
)

__all__ = [
    "EXTRA_FEATURES",
    "LOGPROBS_MODES",
    "MAX_SPARSE_ENTRIES",
    "SAMPLING_EPS",
    "SamplerFlags",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingOptions",
    "SamplingTensors",
    "TokenHistory",
    "apply_grammar_bitmask",
    "compute_logprobs",
    "dummy_tensors",
    "gather_logprobs",
    "greedy_sample",
    "pack_token_bitmask",
    "prompt_logprobs",
    "sample",
    "warmup_flag_sets",
]
