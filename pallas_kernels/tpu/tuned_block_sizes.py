# SPDX-License-Identifier: Apache-2.0
"""Default tuning knobs of the Mosaic TPU ragged paged attention kernel.

NOT measured on hardware: nothing in this repository has run on a TPU yet. The values are
first guesses from the kernel's cost model, to be replaced by a sweep on v5e/v6e:

* a KV block of about 256 tokens per DMA round (`num_kv_pages_per_block * page_size`), so that
  one block's DMA (e.g. 256 tokens x 2K heads x 128 lanes x 2 bytes = 128 KiB per kv head pair)
  is long enough to hide behind the previous block's matmuls, and two such buffers stay far
  below the default scoped VMEM (16 MiB on v5e) for up to 16 kv heads in bf16;
* 32 query rows per block for prefill-heavy batches (a 32 x G by 128 MXU tile), 16 when every
  sequence has one query (decode): the kernel computes every row of a query block against each
  sequence in it, so a small block wastes less MXU work on rows of other sequences;
* no explicit VMEM limit unless the estimate in the kernel exceeds the compiler default.
"""

from __future__ import annotations

# page_size -> pages per KV block (about 256 tokens per block).
KV_PAGES_PER_BLOCK = {8: 32, 16: 16, 32: 8, 64: 4, 128: 2, 256: 1}
TOKENS_PER_KV_BLOCK = 256

QUERIES_PER_BLOCK_PREFILL = 32
QUERIES_PER_BLOCK_DECODE = 16

# Below this, Mosaic's default scoped-VMEM limit is left alone (v5e's default is 16 MiB).
DEFAULT_SCOPED_VMEM_BYTES = 16 * 1024 * 1024


def get_block_sizes(
    *, page_size: int, pages_per_seq: int, num_tokens: int, max_num_seqs: int, sublane_tile: int
) -> tuple[int, int]:
    """(num_kv_pages_per_block, num_queries_per_block) defaults for these static shapes.

    `sublane_tile` is the dtype's second-minor TPU tile (8 for 32-bit, 16 for 16-bit values);
    the query block is a multiple of it.
    """
    pages = KV_PAGES_PER_BLOCK.get(page_size, max(1, TOKENS_PER_KV_BLOCK // page_size))
    pages = max(1, min(pages, pages_per_seq))
    decode_only = num_tokens <= max_num_seqs
    queries = QUERIES_PER_BLOCK_DECODE if decode_only else QUERIES_PER_BLOCK_PREFILL
    # Never more rows than the (tile-aligned) token count: small batches keep one block.
    aligned_tokens = -(-num_tokens // sublane_tile) * sublane_tile
    queries = max(sublane_tile, min(queries, aligned_tokens))
    return pages, -(-queries // sublane_tile) * sublane_tile
