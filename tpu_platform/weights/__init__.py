# SPDX-License-Identifier: Apache-2.0
"""Where a served model's weights come from, and the on-disk forms they are kept in.

`prepared` turns a checkpoint into the served parameters (quantized, fused, sharded, packed for
the native CPU kernel); `cache` keeps them on disk between starts (the weights cache);
`converted` writes and reads a converted model directory (`vllm-xla convert`); `source` picks,
at start, which of them (or the checkpoint) a runner's weights come from.
"""
