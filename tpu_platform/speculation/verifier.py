# SPDX-License-Identifier: Apache-2.0
"""The runner's speculative decoding: which requests get drafts, the drafts of a step and their
verification (`verdict`).

A step with drafts runs the forward as any other; its logits row for a drafted request is the
request's last known token (what it would sample without speculation), so the ordinary sampler can
still serve the step (every draft then counts as rejected). When the step can be verified (no
logits processor among its requests), the step's verdict comes from the logits at each request's
1 + k rows instead, with penalties, bad words, min_tokens, logit biases, allowed ids and grammars
applied at each of them and logprobs computed there (sampling tensors per position:
`position_tensors`; a verify shape's step only). A step of one of
speculative decoding's shapes (the common one: decode rows and their drafts) has those from its
forward, and a greedy step needs no program more (`verdict.greedy_verdict`); a step of another
shape has the hidden states of every row, and a verification program of its request bucket runs
the LM head on the rows gathered on the host (gathering on the device would be one program per
token bucket).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig
from models.registry import architecture_fingerprint
from tpu_platform.buckets import request_buckets
from tpu_platform.inputs import StepPlan
from tpu_platform.programs import Programs, ProgramSpec, structure_text
from tpu_platform.request_table import RequestTable
from tpu_platform.runner_config import RunnerConfig
from tpu_platform.sampling import SamplerFlags, SamplerOutput, SamplingBatch, SamplingTensors, dummy_tensors
from tpu_platform.sampling.uniform import EXTRAS, has_extras, warm_logprobs_width, with_all_extras
from tpu_platform.speculation.config import SpeculationConfig
from tpu_platform.speculation.draft_model import DraftModel
from tpu_platform.speculation.eagle import EagleProposer
from tpu_platform.speculation.eagle3 import Eagle3Proposer
from tpu_platform.speculation.mtp import MtpProposer
from tpu_platform.speculation.ngram import propose_ngram
from tpu_platform.speculation.verdict import (
    SpeculationStats,
    StepDrafts,
    Verification,
    draft_rows,
    greedy_verdict,
    make_verify,
    make_verify_rows,
    on_host,
)
from tpu_platform.step_record import DispatchedStep
from tpu_platform.step_update import StepUpdate
from tpu_platform.weights.prepared import ShardingFor

# The sampler flags a verification program is built for: greedy, random, random with filters
# (a verify shape's greedy steps need none: `verdict.greedy_verdict`).
VERIFY_FLAGS = (SamplerFlags(all_greedy=True), SamplerFlags(), SamplerFlags(filters=True))
RANDOM_FLAGS = VERIFY_FLAGS[1:]
# A verify shape's steps whose requests use penalties, bad words, min_tokens, logit biases,
# allowed ids, grammars or logprobs: every one of those on (neutral where unused), per position
# (`position_tensors`; logprobs at the runner's width: `position_flags`). Greedy, or random with
# the filters on (neutral where unused): two programs a verify shape and k, not three.
POSITION_FLAGS = tuple(
    dataclasses.replace(flags, **dict.fromkeys(EXTRAS, True)) for flags in (VERIFY_FLAGS[0], VERIFY_FLAGS[2])
)


def position_flags(logprobs_width: int | None, logprobs_mode: str) -> tuple[SamplerFlags, ...]:
    """`POSITION_FLAGS` with logprobs at `logprobs_width` (None: none) in `logprobs_mode`."""
    return tuple(
        dataclasses.replace(flags, num_logprobs=logprobs_width, logprobs_mode=logprobs_mode)
        for flags in POSITION_FLAGS
    )


class SpeculativeDecoding:
    """Drafts in and out of the runner (see the module docstring)."""

    def __init__(
        self,
        config: SpeculationConfig,
        graphdef: nnx.GraphDef,
        programs: Programs,
        *,
        hidden_size: int,
        vocab_size: int,
        max_model_len: int,
        feed_width: int,
        sharding: jax.sharding.Sharding | None,
        context: str,
        logprobs_width: int | None = None,
        logprobs_mode: str = "raw_logprobs",
    ):
        self.config = config
        self.programs = programs
        self.stats = SpeculationStats()
        self._jitted = make_verify(graphdef)
        self._jitted_rows = make_verify_rows(feed_width)
        self._hidden_size, self._vocab_size = hidden_size, vocab_size
        self._max_model_len = max_model_len
        self._feed_width = feed_width
        self._sharding = sharding
        self._context = context
        self._logprobs_width = logprobs_width
        self.position_flags = position_flags(logprobs_width, logprobs_mode)
        # Drafts a request for the next step: k, or less where vLLM's per-batch-size schedule says
        # (`StepUpdate.num_spec_tokens`); set by each step's update.
        self.step_tokens = config.num_tokens
        # The drafts a request each verification program takes: k, and the schedule's smaller ones.
        self.verify_tokens = (*config.schedule_tokens, config.num_tokens)
        # The proposer of method 'draft_model' (`draft_model`), 'eagle' (`eagle`), 'eagle3'
        # (`eagle3`) or 'mtp' (`mtp`).
        self.draft: DraftModel | Eagle3Proposer | None = None
        self._draft_warm_up: tuple = ()  # the draft's warm-up arguments, once its cache is there
        # Request rows of the programs, by requests rather than tokens (the LM head runs on 1 + k
        # rows a request: a lone drafted request would otherwise take the row bucket of its 1 + k
        # tokens), in powers of two (`request_buckets`).
        self.row_buckets = request_buckets(feed_width)

    @classmethod
    def for_runner(
        cls,
        graphdef: nnx.GraphDef,
        model_config: ModelConfig,
        config: RunnerConfig,
        sharding: jax.sharding.Sharding | None,
        programs: Programs,
        load_draft: Callable[[str], DraftModel | Eagle3Proposer] | None = None,
    ) -> SpeculativeDecoding | None:
        """A runner's speculative decoding (None when its config has none); `sharding`: where whole
        arrays go on its mesh; `load_draft(path)`: loads a draft model or an EAGLE-3 head
        (`load_proposer`)."""
        if config.speculation is None:
            return None
        fingerprint = architecture_fingerprint(model_config.architecture)
        context = repr((model_config, structure_text(graphdef), config.tensor_parallel_size, fingerprint))
        speculation = cls(
            config.speculation, graphdef, programs, hidden_size=model_config.hidden_size,
            vocab_size=model_config.vocab_size, max_model_len=config.max_model_len,
            feed_width=config.max_num_seqs, sharding=sharding, context=context,
            logprobs_width=warm_logprobs_width(config.max_logprobs, model_config.vocab_size),
            logprobs_mode=config.logprobs_mode,
        )  # fmt: skip
        if config.speculation.draft_model is not None:
            speculation.draft = load_draft(config.speculation.draft_model)
        return speculation

    def initialize(self, num_pages: int, runner_facts: dict, shapes: list, no_feed: jax.Array) -> None:
        """Allocates a draft model's cache and builds its forward (`DraftModel.initialize`:
        `runner_facts` are its keyword arguments); nothing without a draft."""
        if self.draft is None:
            return
        self.draft.initialize(num_pages, feed_width=self._feed_width, **runner_facts)
        max_pages = shapes[0][2]  # the block tables' width, the steps' P
        self._draft_warm_up = (shapes, runner_facts["num_groups"], max_pages, self._max_model_len, no_feed)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states its step hands an EAGLE-3 head (none without)."""
        return self.draft.aux_layers if isinstance(self.draft, Eagle3Proposer) else ()

    def after_forward(
        self, plan: StepPlan, fed: jax.Array, hidden: jax.Array, aux: Sequence[jax.Array]
    ) -> None:
        """Dispatches the draft's forward on the step the target's forward just took, or keeps
        the step and the target's hidden states for the head: its final ones (`hidden`, an MTP
        layer's) or its chosen layers' (`aux`, the forward's extra output: an EAGLE-3 head's)."""
        if isinstance(self.draft, Eagle3Proposer):
            self.draft.forward(plan, self.draft.head_input(hidden, tuple(aux)))
        elif self.draft is not None:
            self.draft.forward(self.programs, plan.packed, plan.dims, fed)

    def apply(self, update: StepUpdate) -> None:
        """Tracks how many drafts the scheduler takes a request after this step (vLLM's
        per-batch-size schedule)."""
        k, wanted = self.config.num_tokens, update.num_spec_tokens
        self.step_tokens = k if wanted is None else min(max(wanted, 0), k)

    def propose(
        self, table: RequestTable, req_ids: Sequence[str], sampled: Sequence[list[int]]
    ) -> list[list[int]]:
        """The drafts of each request of a finished step, the draft model's or the n-gram's (none
        for a request that emitted nothing), at most `step_tokens` each: a
        model proposer's k drafts are cut to their first ones (each follows only those before it,
        so they are the drafts it would make with that k)."""
        wanted = [i for i in range(len(req_ids)) if sampled[i]]
        drafts: list[list[int]] = [[] for _ in req_ids]
        limit = self.step_tokens
        if isinstance(self.draft, Eagle3Proposer):  # its pass runs on every step
            proposed = self.draft.propose(
                self.programs, table, np.array(wanted, np.intp), self._max_model_len
            )
            for i, tokens in zip(wanted, proposed[:, :limit].tolist(), strict=True):
                drafts[i] = [t for t in tokens if t >= 0]
            return drafts
        if not wanted or limit == 0:
            return drafts
        rows = np.fromiter((table.row_of[req_ids[i]] for i in wanted), np.intp, len(wanted))
        c = self.config
        if self.draft is not None:
            proposed = self.draft.propose(self.programs, table, rows, self._max_model_len)
            for i, tokens in zip(wanted, proposed[:, :limit].tolist(), strict=True):
                drafts[i] = [t for t in tokens if t >= 0]
            return drafts
        proposed = propose_ngram(
            table.token_ids[rows], table.num_tokens[rows], k=limit, min_n=c.min_n, max_n=c.max_n,
            max_model_len=self._max_model_len,
        )  # fmt: skip
        for i, tokens in zip(wanted, proposed, strict=True):
            drafts[i] = tokens
        return drafts

    def write_drafts(
        self,
        table: RequestTable,
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        update: StepUpdate,
    ) -> StepDrafts | None:
        """Puts each request's scheduled drafts (its last scheduled tokens) into its history as the
        step's input tokens (placeholders, -1, as token 0) and returns them; None without drafts."""
        spec_tokens = update.spec_tokens
        if not spec_tokens:
            return None
        k, n = self.config.num_tokens, rows.size
        drafts, num_drafts = np.full((n, k), -1, np.int32), np.zeros(n, np.int32)
        for i, req_id in enumerate(update.num_scheduled_tokens):
            ids = spec_tokens.get(req_id)
            if not ids:
                continue
            if len(ids) > k:
                raise ValueError(f"request {req_id} has {len(ids)} drafts, more than k={k}")
            row, count = int(rows[i]), len(ids)
            end = int(table.num_computed[row]) + int(num_scheduled[i])
            drafts[i, :count], num_drafts[i] = ids, count
            table.token_ids[row, end - count : end] = np.maximum(drafts[i, :count], 0)
        return StepDrafts(drafts, num_drafts) if num_drafts.any() else None

    def position_tensors(
        self,
        sampling: SamplingBatch,
        table: RequestTable,
        rows: np.ndarray,
        drafts: StepDrafts,
        padded_rows: int,
        flags: SamplerFlags,
        step_seed: int,
        widths: dict[str, int],
    ) -> tuple[SamplingTensors, SamplerFlags] | None:
        """The sampling tensors of a verify shape's step per verified position, where its requests
        use penalties, bad words, min_tokens, logit biases, allowed ids, logprobs (`flags`, the
        step's own) or grammars: `SamplingBatch.prepare_positions` with every one of those on at
        the fixed `widths` and the runner's logprobs width (`position_flags`), the grammars
        neutral until the step's bitmasks come (`with_position_grammars`). None when they use none."""
        plain = flags.num_logprobs is None and not (flags.penalties or flags.sparse or flags.allowed)
        if plain and not sampling.any_structured(rows):
            return None
        k = self._verify_k(drafts.num_drafts)
        tensors, raw = sampling.prepare_positions(
            rows, drafts.num_drafts, k + 1, padded_rows, table, step_seed
        )
        raw = dataclasses.replace(raw, num_logprobs=flags.num_logprobs, logprobs_mode=flags.logprobs_mode)
        if not raw.all_greedy and not raw.filters:  # the random variant has the filters on
            rows = tensors.temperature.shape[0]
            neutral = dummy_tensors(SamplerFlags(filters=True), rows, self._vocab_size).filters
            tensors = dataclasses.replace(tensors, filters=neutral)
            raw = dataclasses.replace(raw, filters=True)
        return with_all_extras(tensors, raw, self._vocab_size, logprobs_width=self._logprobs_width, **widths)

    @staticmethod
    def with_position_grammars(
        positions: tuple[SamplingTensors, SamplerFlags], masks: Sequence[np.ndarray | None], width: int
    ) -> tuple[SamplingTensors, SamplerFlags]:
        """`positions` with the step's grammar bitmasks: request i's `masks[i]` (`[1 + n, W]`, vLLM's
        rows for its n drafts and the position after them, or None without a grammar) at its
        positions i * width + j, the last row again past them."""
        tensors, flags = positions
        bitmask, rows = tensors.grammar_bitmask.copy(), tensors.grammar_rows.copy()
        words = bitmask.shape[1]
        for i, mask in enumerate(masks):
            if mask is None:
                continue
            # Words past the logits' vocabulary only describe tokens the model cannot emit.
            mask = np.atleast_2d(np.asarray(mask, np.int32))[:, :words]
            at = np.minimum(np.arange(width), mask.shape[0] - 1)
            bitmask[i * width : (i + 1) * width, : mask.shape[1]] = mask[at]
            rows[i * width : (i + 1) * width] = True
        return dataclasses.replace(tensors, grammar_bitmask=bitmask, grammar_rows=rows), flags

    def _verify_k(self, num_drafts: np.ndarray) -> int:
        """The drafts a request of the verification program that serves `num_drafts` takes."""
        return next(t for t in self.verify_tokens if t >= num_drafts.max())

    def try_verify(self, state: nnx.State, pending: DispatchedStep, other: bool) -> Verification | None:
        """Dispatches the verification of a step's drafts; None when it cannot serve the step
        (outside a verify shape's step, some row wants logprobs or a history-reading option, or
        `other`: a grammar there, or a logits processor rewrites the logits): the sampler then
        serves it and every draft counts as rejected."""
        flags = pending.flags
        if other or (has_extras(flags) and pending.positions is None):
            self.stats.unverified_steps += 1
            return None
        num = pending.drafts.num_drafts
        k = self._verify_k(num)
        known = pending.plan.inputs().cu_q_lens[1 : num.size + 1] - 1 - num  # each last known token
        self.stats.verified_steps += 1
        if pending.positions is not None:
            tensors, position_flags = pending.positions
            return self._verify_rows(pending, known, k, position_flags, tensors)
        vflags = SamplerFlags(all_greedy=flags.all_greedy, filters=flags.filters)
        if pending.verify_rows is not None:
            return self._verify_rows(pending, known, k, vflags, pending.tensors)
        return self._verify_hidden(state, pending, known, k, vflags)

    def _verify_rows(
        self,
        pending: DispatchedStep,
        known: np.ndarray,
        k: int,
        flags: SamplerFlags,
        tensors: SamplingTensors,
    ) -> Verification:
        """A verify shape's step: its forward's logits at every row (module docstring); `tensors`
        per request, or per position with `POSITION_FLAGS`."""
        row_logits, row_greedy = pending.verify_rows
        t_pad, r_pad = pending.plan.shape[:2]  # the sampling tensors have the forward's R rows
        index = draft_rows(known, pending.drafts.num_drafts, k, r_pad)
        drafts, num_drafts = pending.drafts.padded(r_pad, k)
        if flags.argmax_only:  # the forward's greedy tokens are each row's first and the verdict's
            verdict = functools.partial(greedy_verdict, row_greedy, index, drafts, num_drafts)
            return Verification(SamplerOutput(pending.greedy), verdict, pending.drafts, self.stats)
        key = ("verify rows", t_pad, r_pad, k, flags)
        spec = lambda: self._rows_spec(t_pad, r_pad, k, flags, tensors)  # noqa: E731
        first, tokens, counts, *logprobs = self.programs.call(
            key, spec, row_logits, index, drafts, num_drafts, tensors
        )
        verdict = on_host(tokens, counts)
        return Verification(SamplerOutput(first), verdict, pending.drafts, self.stats, *logprobs)

    def _verify_hidden(
        self, state: nnx.State, pending: DispatchedStep, known: np.ndarray, k: int, flags: SamplerFlags
    ) -> Verification:
        """A step of another shape: the LM head again on its rows' hidden states (module docstring)."""
        num = pending.drafts.num_drafts
        r_pad = next(r for r in self.row_buckets if r >= num.size)
        # Prepared for the forward's rows, which a verify bucket's step has as many of (no slicing
        # ops to dispatch then).
        tensors = jax.tree.map(lambda x: x if x.shape[0] == r_pad else x[:r_pad], pending.tensors)
        index = draft_rows(known, num, k, r_pad)
        hidden_rows = np.asarray(pending.hidden)[index.reshape(-1)]
        drafts, num_drafts = pending.drafts.padded(r_pad, k)
        key = self._key(r_pad, k, flags, hidden_rows.dtype)
        spec = lambda: self._spec(state, r_pad, k, flags, hidden_rows.dtype, tensors)  # noqa: E731
        first, tokens, counts = self.programs.call(key, spec, state, hidden_rows, drafts, num_drafts, tensors)
        return Verification(SamplerOutput(first), on_host(tokens, counts), pending.drafts, self.stats)

    def warm_up_specs(
        self,
        state: nnx.State,
        sampling: SamplingBatch,
        dtype: np.dtype,
        verify_shapes: Sequence[tuple[int, int]],
        widths: dict[str, int],
    ) -> list[ProgramSpec]:
        """The verification programs: of every row bucket, draft count and flag set from hidden
        states, of every verify shape (`verify_shapes`), draft count and random flag set from
        the forward's rows, and the same per position (`POSITION_FLAGS`, tensors of the fixed
        `widths`); and a draft model's."""
        specs = [
            self._spec(state, r_pad, k, flags, dtype, sampling.dummy_tensors(flags, r_pad))
            for r_pad in self.row_buckets
            for k in self.verify_tokens
            for flags in VERIFY_FLAGS
        ]
        specs += [
            self._rows_spec(t_pad, r_pad, k, flags, sampling.dummy_tensors(flags, r_pad))
            for t_pad, r_pad in verify_shapes
            for k in self.verify_tokens
            for flags in RANDOM_FLAGS
        ]
        specs += [
            self._rows_spec(t_pad, r_pad, k, flags, sampling.dummy_tensors(flags, r_pad * (k + 1), **widths))
            for t_pad, r_pad in verify_shapes
            for k in self.verify_tokens
            for flags in self.position_flags
        ]
        if isinstance(self.draft, Eagle3Proposer):  # the head takes the target's activations
            specs += self.draft.warm_up_specs(*self._draft_warm_up[:4], dtype)
        elif self.draft is not None:
            specs += self.draft.warm_up_specs(*self._draft_warm_up)
        return specs

    def _key(self, r_pad: int, k: int, flags: SamplerFlags, dtype: np.dtype) -> tuple:
        return ("verify", r_pad, k, flags, np.dtype(dtype).name)

    def _spec(
        self,
        state: nnx.State,
        r_pad: int,
        k: int,
        flags: SamplerFlags,
        dtype: np.dtype,
        tensors: SamplingTensors,
    ) -> ProgramSpec:
        whole = self._sharding
        return ProgramSpec(
            key=self._key(r_pad, k, flags, dtype),
            jitted=self._jitted,
            args=(
                state,
                jax.ShapeDtypeStruct((r_pad * (k + 1), self._hidden_size), dtype, sharding=whole),
                jax.ShapeDtypeStruct((r_pad, k), np.int32, sharding=whole),
                jax.ShapeDtypeStruct((r_pad,), np.int32, sharding=whole),
                tensors,
            ),
            static={"flags": flags, "feed_width": self._feed_width},
            context=self._context,
        )

    def _rows_spec(
        self, t_pad: int, r_pad: int, k: int, flags: SamplerFlags, tensors: SamplingTensors
    ) -> ProgramSpec:
        whole = self._sharding
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=whole)  # noqa: E731
        return ProgramSpec(
            key=("verify rows", t_pad, r_pad, k, flags),
            jitted=self._jitted_rows,
            args=(
                jax.ShapeDtypeStruct((t_pad, self._vocab_size), np.float32, sharding=whole),
                ints(r_pad, k + 1),
                ints(r_pad, k),
                ints(r_pad),
                tensors,
            ),
            static={"flags": flags},
            context=f"verify rows, tokens padded to {self._feed_width}",
        )


def load_proposer(
    path: str,
    *,
    config: RunnerConfig,
    target: ModelConfig,
    target_model: nnx.Module,
    dtype: jnp.dtype,
    dense_isa: str | None,
    shardings: ShardingFor,
    device: jax.Device,
    mesh: jax.sharding.Mesh | None = None,
) -> DraftModel | Eagle3Proposer:
    """The proposer at `path` for the runner's speculation method: a draft model (`DraftModel.load`),
    an EAGLE-3 head (`Eagle3Proposer.load`, reading `target_model`'s hidden states), an EAGLE
    head (`EagleProposer.load`, reading its final ones) or the MTP
    layer of the target's own checkpoint (`MtpProposer.load`: `path` is the target's), on
    `device` or split on the target's tensor-parallel `mesh` as the target is."""
    method = config.speculation.method
    if method in ("eagle", "eagle3", "mtp"):
        proposer = {"eagle": EagleProposer, "eagle3": Eagle3Proposer, "mtp": MtpProposer}[method]
        return proposer.load(
            path, k=config.speculation.num_tokens, target=target, target_model=target_model, dtype=dtype,
            max_model_len=config.max_model_len, device=device, mesh=mesh,
        )  # fmt: skip
    return DraftModel.load(path, config, target, dtype, dense_isa, shardings, device, mesh)
