# SPDX-License-Identifier: Apache-2.0
"""Which cache files are safe to unpickle or restore: those only the current user could have written.

The rule (the file, its directory and every ancestor; files read through the descriptor that
was judged) lives in `pallas_kernels.private_files`, beside the native kernels' build, which
needs it and sits below this package; this module adds whole directory trees (a checkpoint
directory is read whole, by a library that opens its files by path).
"""

from __future__ import annotations

import os

from pallas_kernels.private_files import (
    UnsafeCacheError,
    check_private,
    make_private_dir,
    open_private,
    open_private_file,
    own_reason,
    unsafe_reason,
)

__all__ = [
    "UnsafeCacheError",
    "check_private",
    "make_private_dir",
    "make_tree_private",
    "open_private",
    "open_private_file",
    "unsafe_reason",
    "unsafe_tree_reason",
]


def _tree(directory: str) -> list[str]:
    """`directory` and everything in it."""
    paths = []
    for root, dirs, files in os.walk(directory):
        paths += [root, *(os.path.join(root, name) for name in (*dirs, *files))]
    return paths


def unsafe_tree_reason(directory: str) -> str | None:
    """Why another user could have written something in `directory` (a checkpoint read whole):
    `unsafe_reason` of itself (its parent and every ancestor) and of everything in it; or None.
    With every ancestor trusted, nobody else can swap what was checked before it is read."""
    if not os.path.exists(directory):
        return None
    inside = _tree(directory)[1:]  # below a checked directory: their own status is enough
    reasons = (unsafe_reason(directory), *map(_own_unless_gone, inside))
    return next((reason for reason in reasons if reason), None)


def _own_unless_gone(path: str) -> str | None:
    try:
        return own_reason(path)
    except FileNotFoundError:  # removed since the walk (a concurrent clean-up): nothing to read
        return None


def make_tree_private(directory: str) -> None:
    """Takes group and other permissions off `directory` and everything in it (a library that
    writes under the process's umask, e.g. Orbax, leaves them; `unsafe_tree_reason` would then
    refuse what was written)."""
    for path in _tree(directory):
        os.chmod(path, os.lstat(path).st_mode & 0o700)
