# SPDX-License-Identifier: Apache-2.0
"""Pure-jnp Gated DeltaNet (Qwen3-Next, Qwen3.5 linear attention): the token-by-token recurrent
oracle, the chunkwise-parallel form over a ragged batch, and the causal depthwise conv1d with its
carried state. Today these are the path of every backend (`gated_delta.py`).

The gated delta rule keeps a state `S [H, K, V]` per sequence and head. For each token, with q
and k L2-normalized over K and q scaled by `K ** -0.5`:

    S = exp(g) * S                      (the gate: g <= 0, a decay in log space)
    S = S + k (beta * (v - S^T k))^T    (the delta rule: write the part S does not predict)
    o = S^T q

The chunkwise form (the WY/UT representation) splits each sequence into chunks of C tokens.
Inside a chunk, `(I + tril(beta k k^T * decay, -1)) U = beta v` (a unit lower-triangular solve)
turns the C sequential rank-one updates into matmuls; only the chunk-to-chunk state passes in
order. This is the algebra of transformers' `torch_chunk_gated_delta_rule`.

Ragged batches: sequence i owns rows `cu_q_lens[i]:cu_q_lens[i+1]` of a step, its next tokens,
and starts from the state in slot `state_indices[i]` of the state pool (zeros when
`has_initial_state[i]` is false, a new request); its final state is written back to that slot.

Speculative decoding keeps a state after each verified position, so that the next step resumes
after the last accepted draft (vLLM's `num_speculative_blocks`): then `state_indices` is `[R, P]`,
P slots a sequence. A sequence starts from its slot in column 0; one of 1 to P rows leaves the
state after its row j in its slot in column j, a longer one (a prefill chunk) its final state in
column 0. With P = 1 this is the one-slot rule above. Inside the chunkwise form the state after
row r of a chunk is `exp(cum_r) S + sum_{c <= r} exp(cum_r - cum_c) k_c u_c^T` (u the chunk's
UT-solved values less what the incoming state predicts), taken in the rounds that hold a
sequence's first P rows.
Chunks never span two sequences: the step's rows become a flat list of chunks (at most
`ceil(T / C) + R`), and the chunk-to-chunk scan runs in rounds, round j taking the j-th chunk of
every sequence at once, for as many rounds as the longest sequence has chunks. A step of no more
rows than sequences (decodes) uses chunks of one token, the recurrent update.

Axis letters: T rows, R sequences, N chunks, C chunk length, H value heads, G key heads, K key
dim, V value dim, D conv channels, W conv kernel width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon


def l2_normalize(x: jax.Array) -> jax.Array:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _prepare(q: jax.Array, k: jax.Array, num_heads: int, qk_l2norm: bool) -> tuple[jax.Array, jax.Array]:
    """q, k `[..., G, K]` -> float32 `[..., H, K]`: normalized, each key head repeated for its
    `H / G` value heads, q scaled by `K ** -0.5`."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    repeats = num_heads // q.shape[-2]
    if repeats > 1:
        q, k = jnp.repeat(q, repeats, axis=-2), jnp.repeat(k, repeats, axis=-2)
    return q * q.shape[-1] ** -0.5, k


@functools.partial(jax.jit, static_argnames=("qk_l2norm",))
def gated_delta_rule_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The naive oracle: one sequence, token by token. q, k `[L, G, K]`, v `[L, H, V]`, g, beta
    `[L, H]`, initial_state `[H, K, V]` (zeros if None). Returns float32 `o [L, H, V]` and the
    final state `[H, K, V]`."""
    num_heads = v.shape[1]
    q, k = _prepare(q, k, num_heads, qk_l2norm)
    state = jnp.zeros((num_heads, k.shape[-1], v.shape[-1]), jnp.float32)
    if initial_state is not None:
        state = initial_state.astype(jnp.float32)

    def token(s, inputs):
        q_t, k_t, v_t, g_t, b_t = inputs  # [H, K], [H, K], [H, V], [H], [H]
        s = s * jnp.exp(g_t)[:, None, None]
        predicted = jnp.einsum("hkv,hk->hv", s, k_t)
        s = s + k_t[:, :, None] * (b_t[:, None] * (v_t - predicted))[:, None, :]
        return s, jnp.einsum("hkv,hk->hv", s, q_t)

    xs = (q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32))
    state, o = lax.scan(token, state, xs)
    return o, state


def _chunk_table(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, chunk: int):
    """The step's rows as chunks of one sequence each. Returns, for N = ceil(T / C) + R chunks:
    rows `[N, C]` (T where the chunk has no such row), the first chunk of each sequence `[R]`,
    each sequence's chunk count `[R]`."""
    num_seq_slots = cu_q_lens.shape[0] - 1
    num_chunks = -(-num_tokens // chunk) + num_seq_slots
    live = jnp.arange(num_seq_slots) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    chunks_per_seq = -(-q_lens // chunk)
    first_chunk = jnp.cumsum(chunks_per_seq) - chunks_per_seq
    n = jnp.arange(num_chunks)
    seq = jnp.clip(jnp.searchsorted(first_chunk + chunks_per_seq, n, side="right"), 0, num_seq_slots - 1)
    row = cu_q_lens[seq][:, None] + (n - first_chunk[seq])[:, None] * chunk + jnp.arange(chunk)
    end = jnp.where(n < jnp.sum(chunks_per_seq), cu_q_lens[seq + 1], 0)[:, None]
    return jnp.where(row < end, row, num_tokens), first_chunk, chunks_per_seq


def _gather_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    """`x[rows]` with zeros for out-of-range rows (a chunk's padding)."""
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """`(I + L)^-1` for strictly lower-triangular `L [..., C, C]`, by blocked inversion in
    matmuls: diagonal blocks of size b become blocks of 2b with `T21 = -T22 L21 T11`, log2(C)
    rounds. Not `lax.linalg.triangular_solve`: on CPU that is LAPACK's trsm, which spreads its
    batch over the intra-op thread pool and waits on it; several simulated devices inside it at
    once hold every thread of that pool and none returns."""
    size = strict.shape[-1]
    padded = 1 << max(size - 1, 0).bit_length()  # the next power of two: blocks halve evenly
    if padded != size:
        pad = [(0, 0)] * (strict.ndim - 2) + [(0, padded - size)] * 2
        strict = jnp.pad(strict, pad)
    batch = strict.shape[:-2]
    blocks = jnp.ones((*batch, padded, 1, 1), strict.dtype)  # the inverse's diagonal blocks
    width = 1
    while width < padded:
        pairs = padded // (2 * width)
        tiles = strict.reshape(*batch, pairs, 2 * width, pairs, 2 * width)
        lower = jnp.diagonal(tiles, axis1=-4, axis2=-2)  # [..., 2w, 2w, pairs]
        lower = jnp.moveaxis(lower, -1, -3)[..., width:, :width]  # [..., pairs, w, w]
        halves = blocks.reshape(*batch, pairs, 2, width, width)
        first, second = halves[..., 0, :, :], halves[..., 1, :, :]
        corner = -(second @ lower @ first)
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        bottom = jnp.concatenate([corner, second], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)  # [..., pairs, 2w, 2w]
        width *= 2
    return blocks.reshape(*batch, padded, padded)[..., :size, :size]


def _intra_chunk(q, k, v, g, beta):
    """Each chunk's own part, all chunks at once. Inputs `[N, C, H, ...]` (padding rows zero).
    Returns, per chunk and head (`[N, H, ...]`): the UT-solved values `[C, V]`, the keys that read
    the incoming state `[C, K]`, the decayed queries `[C, K]`, the intra-chunk scores `[C, C]`,
    the keys that write the outgoing state `[C, K]`, the chunk's total decay `[]`, and what the
    state after each row takes (`_row_states`): the keys `[C, K]`, the decay of the incoming
    state to each row `[C]` and from each row to each later one `[C, C]`."""
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [N, H, C, *]
    g, beta = jnp.swapaxes(g, 1, 2), jnp.swapaxes(beta, 1, 2)  # [N, H, C]
    size = q.shape[2]
    cum = jnp.cumsum(g, axis=-1)  # [N, H, C]
    causal = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [N, H, C, C]
    k_beta = k * beta[..., None]
    system = jnp.einsum("nhik,nhjk->nhij", k_beta, k) * decay
    system = jnp.where(jnp.tril(jnp.ones((size, size), bool), -1), system, 0.0)
    inverse = unit_lower_inverse(system)  # [N, H, C, C]
    values = inverse @ (v * beta[..., None])  # [N, H, C, V]
    state_keys = inverse @ (k_beta * jnp.exp(cum)[..., None])  # [N, H, C, K]
    scores = jnp.einsum("nhik,nhjk->nhij", q, k) * decay
    reads = q * jnp.exp(cum)[..., None]
    writes = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    rows = (k, jnp.exp(cum), decay)
    return values, state_keys, reads, scores, writes, jnp.exp(cum[..., -1]), rows


def _row_states(state, rows, fresh, count):
    """The states after a chunk's first `count` rows, each `[R, H, K, V]`: the incoming `state`
    decayed to the row plus the rows up to it (module docstring). `rows`: `_intra_chunk`'s
    per-row parts of each sequence's chunk, `fresh` `[R, H, C, V]` its u."""
    keys, decay_in, decay = rows  # [R, H, C, K], [R, H, C], [R, H, C, C]
    return [
        decay_in[:, :, r, None, None] * state + jnp.einsum("rhc,rhck,rhcv->rhkv", decay[:, :, r], keys, fresh)
        for r in range(count)
    ]


def _write_row_states(pool, states, first_row, slots, writes_rows, q_lens):
    """`pool` with `states[r]` (the state after row `first_row + r` of each sequence) in the
    sequence's slot of that column, for the sequences that `writes_rows` and have such a row."""
    for r, s in enumerate(states):
        row = first_row + r
        column = jnp.clip(row, 0, slots.shape[1] - 1)
        target = jnp.where(writes_rows & (row < q_lens), slots[:, column], pool.shape[0])
        pool = pool.at[target].set(s.astype(pool.dtype), mode="drop")
    return pool


@functools.partial(jax.jit, static_argnames=("chunk_size", "qk_l2norm"))
def gated_delta_rule_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    chunk_size: int = 64,
    qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The chunkwise gated delta rule over a ragged batch (module docstring).

    q, k `[T, G, K]`, v `[T, H, V]`, g, beta `[T, H]` (g the log decay, beta the write strength,
    already activated); state `[S, H, K, V]` the pool of state slots; state_indices `[R]` int32
    (or `[R, P]`: a state after each of a sequence's first P rows, module docstring),
    has_initial_state `[R]` bool, cu_q_lens `[R + 1]`, num_seqs int32 scalar or `[1]`. Rows past
    `cu_q_lens[num_seqs]` are padding (zeros out) and sequences past num_seqs touch no slot.
    Returns `o [T, H, V]` in v's dtype and the updated pool (donate it to update in place).
    """
    num_tokens, num_heads = v.shape[:2]
    slots = state_indices.reshape(state_indices.shape[0], -1)  # [R, P]
    num_seq_slots, positions = slots.shape
    num_seqs = jnp.reshape(num_seqs, ())
    chunk = 1 if num_tokens <= num_seq_slots else chunk_size
    q, k = _prepare(q, k, num_heads, qk_l2norm)
    rows, first_chunk, chunks_per_seq = _chunk_table(cu_q_lens, num_seqs, num_tokens, chunk)
    inputs = [_gather_rows(x.astype(jnp.float32), rows) for x in (q, k, v, g, beta)]
    values, state_keys, reads, scores, writes, chunk_decay, row_parts = _intra_chunk(*inputs)

    live = jnp.arange(num_seq_slots) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    # With P > 1, a sequence of 1 to P rows leaves the state after each of them (module docstring).
    writes_rows = live & (q_lens >= 1) & (q_lens <= positions) & (positions > 1)
    read = jnp.clip(slots[:, 0], 0, state.shape[0] - 1)
    start = jnp.where((live & has_initial_state)[:, None, None, None], state[read].astype(jnp.float32), 0.0)
    out = jnp.zeros_like(values)  # [N, H, C, V]
    row_count = min(chunk, positions)  # rows of a chunk that may be among a sequence's first P

    def one_round(j, carry, pool=None):
        """Round j of every sequence's chunks; with `pool` (P > 1), it written with the states
        after the round's rows among each sequence's first P."""
        s, out = carry  # [R, H, K, V], [N, H, C, V]
        ids = first_chunk + j
        active = j < chunks_per_seq
        take = lambda x: jnp.take(x, ids, axis=0, mode="clip")  # noqa: E731
        fresh = take(values) - jnp.einsum("rhck,rhkv->rhcv", take(state_keys), s)
        o = jnp.einsum("rhck,rhkv->rhcv", take(reads), s) + jnp.einsum("rhij,rhjv->rhiv", take(scores), fresh)
        s_next = s * take(chunk_decay)[..., None, None] + jnp.einsum("rhck,rhcv->rhkv", take(writes), fresh)
        out = out.at[jnp.where(active, ids, out.shape[0])].set(o, mode="drop")
        if pool is not None:
            states = _row_states(s, [take(x) for x in row_parts], fresh, row_count)
            pool = _write_row_states(pool, states, j * chunk, slots, writes_rows & active, q_lens)
        return (jnp.where(active[:, None, None, None], s_next, s), out), pool

    # The rounds that hold a sequence's first P rows (P > 1) run unrolled, before the loop: the
    # pool they write then never passes through a loop's carry or a conditional, which XLA would
    # copy whole (a pool-sized temporary) instead of updating in place.
    unrolled = -(-positions // chunk) if positions > 1 else 0
    carry = (start, out)
    for j in range(unrolled):
        carry, state = one_round(j, carry, state)
    final, out = lax.fori_loop(unrolled, jnp.max(chunks_per_seq), lambda j, c: one_round(j, c)[0], carry)
    o = jnp.zeros((num_tokens + 1, num_heads, v.shape[-1]), jnp.float32)
    o = o.at[rows.reshape(-1)].set(jnp.swapaxes(out, 1, 2).reshape(-1, num_heads, v.shape[-1]))
    state = state.at[jnp.where(live & ~writes_rows, slots[:, 0], state.shape[0])].set(
        final.astype(state.dtype), mode="drop"
    )
    return o[:num_tokens].astype(v.dtype), state


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d_reference(
    x: jax.Array,
    weight: jax.Array,
    conv_state: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv1d over a ragged batch, each sequence continuing from its carried
    inputs. x `[T, D]`; weight `[W, D]` (tap w multiplies the input `W - 1 - w` rows back);
    conv_state `[S, W - 1, D]`, a slot's last `W - 1` inputs, oldest first (zeros when
    `has_initial_state` is false); state_indices (`[R]` or `[R, P]`), has_initial_state,
    cu_q_lens, num_seqs as in `gated_delta_rule_reference`. Returns `silu(conv + bias)` (or
    without the silu) `[T, D]` in x's dtype and the pool with each live sequence's last `W - 1`
    inputs written back (with P > 1, for a sequence of 1 to P rows: the last `W - 1` inputs up to
    its row j in its slot of column j)."""
    num_tokens = x.shape[0]
    width = weight.shape[0]
    slots = state_indices.reshape(state_indices.shape[0], -1)  # [R, P]
    num_seq_slots, positions = slots.shape
    num_seqs = jnp.reshape(num_seqs, ())
    live = jnp.arange(num_seq_slots) < num_seqs
    read = jnp.clip(slots[:, 0], 0, conv_state.shape[0] - 1)
    carried = jnp.where((live & has_initial_state)[:, None, None], conv_state[read], 0)  # [R, W-1, D]
    # Row t's sequence and its index inside this step's rows of it.
    seq = jnp.clip(
        jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens), side="right"), 0, num_seq_slots - 1
    )
    start = cu_q_lens[seq]

    def input_at(s: jax.Array, i: jax.Array) -> jax.Array:
        """Sequence s's input i rows into this step (negative: from the carried state)."""
        row = _gather_rows(x, jnp.where(i >= 0, cu_q_lens[s] + i, num_tokens))
        past = carried[s, jnp.clip(width - 1 + i, 0, width - 2)]
        return jnp.where((i >= 0)[..., None], row, past.astype(x.dtype))

    index = jnp.arange(num_tokens) - start  # [T]
    taps = index[:, None] - (width - 1) + jnp.arange(width)  # [T, W]
    windows = input_at(seq[:, None], taps).astype(jnp.float32)  # [T, W, D]
    y = jnp.einsum("twd,wd->td", windows, weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation:
        y = jax.nn.silu(y)
    real = jnp.arange(num_tokens) < cu_q_lens[num_seqs]
    y = jnp.where(real[:, None], y, 0.0).astype(x.dtype)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    sequences = jnp.arange(num_seq_slots)[:, None]
    last = q_lens[:, None] - (width - 1) + jnp.arange(width - 1)  # [R, W-1]
    new = input_at(sequences, last)  # [R, W-1, D]
    writes_rows = live & (q_lens >= 1) & (q_lens <= positions) & (positions > 1)
    target = jnp.where(live & ~writes_rows, slots[:, 0], conv_state.shape[0])
    if positions > 1:  # the inputs up to each of a short sequence's rows, in that row's column
        rows = jnp.arange(positions)
        upto = rows[:, None] - (width - 2) + jnp.arange(width - 1)  # [P, W-1]
        windows = input_at(sequences[:, :, None], upto[None])  # [R, P, W-1, D]
        written = writes_rows[:, None] & (rows[None] < q_lens[:, None])
        target = jnp.concatenate([target, jnp.where(written, slots, conv_state.shape[0]).reshape(-1)])
        new = jnp.concatenate([new, windows.reshape(-1, *windows.shape[2:])])
    # One scatter for both: two in a row into the pool make XLA's TPU compiler copy it whole.
    conv_state = conv_state.at[target].set(new.astype(conv_state.dtype), mode="drop")
    return y, conv_state
