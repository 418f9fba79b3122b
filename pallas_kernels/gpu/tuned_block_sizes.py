# SPDX-License-Identifier: Apache-2.0
"""Default tuning knobs of the Pallas Triton ragged paged attention kernel.

First guesses, kept after one sweep on an H200 (`benchmarks/device_check.py`): its best tunings
there were within the sweep's own noise of these. A100 and L4 have not run them:

* KV blocks of 64 tokens (`num_kv_pages_per_block * page_size`): two `[64, D]` tiles plus the
  `[M, 64]` scores fit the register file at 4 warps for D <= 128, as in flash-decoding kernels;
  fewer tokens when one K (or V) tile of the block would pass 16 KiB (head dim 256 in bfloat16,
  float32 caches): Triton keeps `num_stages` blocks of K and V in shared memory, and the
  compiler refuses a kernel that asks for more than the GPU has per block (99 KiB on an L4,
  163 KiB on an A100; the real compilers showed 64-token bfloat16 blocks of head dim 256 over
  the L4's limit);
* up to 16 query rows per program for prefill-heavy batches; for decode buckets (one query per
  sequence) a single row, so that a program's M = G rows (padded to 16 for `tl.dot`) are all
  one sequence's query heads;
* KV splits (flash-decoding): 8 for decode buckets, where the grid would otherwise have only
  R x K programs, 1 when the query rows alone give enough programs;
* num_warps 4, num_stages 2 (Triton's software-pipelining depth for the page loads).
"""

from __future__ import annotations

TOKENS_PER_KV_BLOCK = 64
KV_TILE_BYTES = 16 * 1024  # most bytes of one K (or V) tile of a KV block
QUERIES_PER_BLOCK_PREFILL = 16
QUERIES_PER_BLOCK_DECODE = 1
KV_SPLITS_DECODE = 8
KV_SPLITS_PREFILL = 1
NUM_WARPS = 4
NUM_STAGES = 2


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def get_block_sizes(
    *, page_size: int, pages_per_seq: int, num_tokens: int, max_num_seqs: int, kv_row_bytes: int
) -> tuple[int, int, int]:
    """(num_kv_pages_per_block, num_queries_per_block, num_kv_splits) for these static shapes.

    `kv_row_bytes`: bytes of one token's K (or V) row of one head in the cache (Dp * itemsize).
    """
    tokens = max(1, min(TOKENS_PER_KV_BLOCK, KV_TILE_BYTES // kv_row_bytes))
    pages = _pow2_floor(max(1, tokens // page_size))
    pages = min(pages, _pow2_floor(pages_per_seq))
    decode_only = num_tokens <= max_num_seqs
    queries = QUERIES_PER_BLOCK_DECODE if decode_only else QUERIES_PER_BLOCK_PREFILL
    splits = KV_SPLITS_DECODE if decode_only else KV_SPLITS_PREFILL
    blocks_per_seq = -(-pages_per_seq // pages)
    return pages, queries, max(1, min(splits, blocks_per_seq))


def blocks_per_page(*, page_size: int, kv_row_bytes: int) -> int:
    """KV blocks a page is read in: 1, unless one page's K (or V) tile would pass `KV_TILE_BYTES`
    (a hybrid model's pages, raised until one holds a linear-attention state, run to hundreds of
    tokens); then slices of a power of two tokens, at least 16 (`tl.dot`'s least dimension)."""
    tokens = _pow2_floor(max(16, KV_TILE_BYTES // kv_row_bytes))
    return max(1, page_size // tokens)
