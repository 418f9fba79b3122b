# SPDX-License-Identifier: Apache-2.0
"""A tiny vLLM IO-processor plugin, installed for a test through its entry point: words in (each
word a token id, from its bytes), the embedding model's pooled rows out, each with the index of
its largest component."""

from __future__ import annotations

import os
import textwrap

NAME = "word_ids"

PLUGIN = textwrap.dedent(
    '''
    from vllm.inputs import TokensPrompt
    from vllm.plugins.io_processors.interface import IOProcessor
    from vllm.pooling_params import PoolingParams


    def word_token_ids(words):
        """BOS, then one token a word: 3 + the sum of its bytes modulo 381 (a 384-token vocabulary)."""
        return [1, *(3 + sum(w.encode()) % 381 for w in words)]


    class WordIdsProcessor(IOProcessor):
        def parse_data(self, data):
            sentences = data.get("sentences") if isinstance(data, dict) else None
            if not sentences or not all(
                isinstance(s, list) and s and all(isinstance(w, str) for w in s) for s in sentences
            ):
                raise ValueError("data must be {'sentences': [[word, ...], ...]}")
            return sentences

        def merge_pooling_params(self, params=None):
            return PoolingParams(task="embed")

        def pre_process(self, prompt, request_id=None, **kwargs):
            return [TokensPrompt(prompt_token_ids=word_token_ids(words)) for words in prompt]

        def post_process(self, model_output, request_id=None, **kwargs):
            rows = [out.outputs.data.tolist() for out in model_output]
            return {
                "prompt_token_ids": [list(out.prompt_token_ids) for out in model_output],
                "embeddings": rows,
                "largest": [max(range(len(r)), key=r.__getitem__) for r in rows],
            }


    def register():
        return "word_ids_plugin.WordIdsProcessor"
    '''
)


def install(site_dir: str) -> str:
    """The package `word_ids_plugin` and its dist-info with a `vllm.io_processor_plugins` entry
    point under `site_dir` (a directory to put on the server's `PYTHONPATH`); returns `site_dir`."""
    package = os.path.join(site_dir, "word_ids_plugin")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(PLUGIN)
    info = os.path.join(site_dir, "word_ids_plugin-0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: word-ids-plugin\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[vllm.io_processor_plugins]\n{NAME} = word_ids_plugin:register\n")
    return site_dir


def word_token_ids(words: list[str]) -> list[int]:
    """The plugin's token ids of a sentence (the same rule, for the test's reference)."""
    return [1, *(3 + sum(w.encode()) % 381 for w in words)]
