# SPDX-License-Identifier: Apache-2.0
"""What the on-disk caches (compiled programs, prepared weights) share: the fingerprint of our
code that keys their entries, atomic writes, and the sweep that removes entries no start has used
for a while.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from tpu_platform.collector import collector_paused
from tpu_platform.private_files import open_private

logger = logging.getLogger(f"vllm_xla.{__name__}")

_PACKAGES = ("models", "pallas_kernels", "tpu_platform")
_DIGESTS_FILE = "source-digests.json"  # in the executable cache's directory
_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def source_fingerprint(
    root: Path = _ROOT, packages: tuple[str, ...] = _PACKAGES, memo_dir: str | None = None
) -> str:
    """A hash of the packages' code: every module's syntax tree (not comments or docstrings), C++ sources.

    With `memo_dir`, each module's syntax-tree digest is kept there under the hash of its bytes,
    so a start parses only the modules that changed (parsing all of them was a visible part of a
    warm start)."""
    memo = _read_digests(memo_dir)
    used: dict[str, str] = {}
    digest = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_bytes()
            key = hashlib.sha256(source).hexdigest()
            used[key] = memo.get(key) or _syntax_digest(source)
            digest.update(str(path.relative_to(root)).encode())
            digest.update(used[key].encode())
        native = [*(root / package).rglob("*.cc"), *(root / package).rglob("*.h")]
        for path in sorted(native):  # native kernels: compiled in
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    if memo_dir is not None and not used.keys() <= memo.keys():
        _write_digests(memo_dir, used)  # this code's modules only: the memo does not grow
    return digest.hexdigest()


def _syntax_digest(source: bytes) -> str:
    """The hash of a module's syntax tree, docstrings removed."""
    # Python 3.11 counts the syntax-tree constructor's depth per interpreter, not per thread: a
    # collection inside the parse can run finalizers that switch threads, and another thread's
    # parse then makes this one fail with "AST constructor recursion depth mismatch". Without the
    # collector the parse runs to its end before another thread's Python runs.
    with collector_paused():
        tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)


def _read_digests(memo_dir: str | None) -> dict[str, str]:
    try:
        with open(os.path.join(memo_dir, _DIGESTS_FILE)) as f:
            memo = json.load(f)
    except (TypeError, OSError, ValueError):  # no directory, no file yet, or a torn one
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_digests(memo_dir: str, digests: dict[str, str]) -> None:
    path = os.path.join(memo_dir, _DIGESTS_FILE)
    try:
        write_atomically(path, json.dumps(digests).encode())
    except OSError as error:
        logger.warning("could not keep the source digests at %s (%s)", path, error)


def write_atomically(path: str, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file: readers never see part of it."""
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open_private(partial) as f:
            f.write(data)
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)  # gone already once replaced


# A cache entry not used for this long goes (another version's or configuration's, most likely).
UNUSED_ENTRY_SECONDS = 30 * 24 * 3600


def remove_unused(directory: str, suffix: str, unused_seconds: float = UNUSED_ENTRY_SECONDS) -> int:
    """Removes the `*suffix` files of `directory` last used (modified: loading one touches it)
    more than `unused_seconds` ago; returns how many. Cache directories then stop growing with
    every code or configuration change."""
    cutoff, removed = time.time() - unused_seconds, 0
    for entry in Path(directory).glob(f"*{suffix}"):
        try:
            if entry.stat().st_mtime < cutoff:
                entry.unlink()
                removed += 1
        except OSError:  # gone already, or not ours to remove
            continue
    return removed


def mark_used(path: str) -> None:
    """Touches a cache entry, so that `remove_unused` keeps it."""
    try:
        os.utime(path)
    except OSError:
        pass
