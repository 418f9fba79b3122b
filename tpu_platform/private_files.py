# SPDX-License-Identifier: Apache-2.0
"""Which cache files are safe to unpickle: those only the current user could have written.

Loading a pickle runs whatever code its author chose, so the executable cache and the weights
cache read a file only when it and its directory belong to the current user and neither is
writable by group or others, the rule ssh applies to its keys. Anything else is refused with a
message naming the path and the fix; the caller then compiles or loads from the source.
"""

from __future__ import annotations

import os
import stat


class UnsafeCacheError(PermissionError):
    """A cache file or directory that another user could have written."""


def unsafe_reason(path: str) -> str | None:
    """Why `path` (a file or directory) could hold someone else's content, or None when only the
    current user can have written it. A missing path is not unsafe."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not by the current user (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"`chmod go-w {path}` makes it usable"
        )
    return None


def check_private(path: str) -> None:
    """Raises UnsafeCacheError unless `path` and its directory could only be written by the
    current user (see `unsafe_reason`)."""
    for candidate in (os.path.dirname(os.path.abspath(path)), path):
        reason = unsafe_reason(candidate)
        if reason is not None:
            raise UnsafeCacheError(f"refusing to load cached data from {path}: {reason}")


def make_private_dir(path: str) -> None:
    """Creates `path` (and its parents) readable and writable by the current user only; an
    existing directory is left as it is (`check_private` judges it)."""
    os.makedirs(path, mode=0o700, exist_ok=True)


def open_private(path: str):
    """`path` opened for writing bytes, created readable and writable by the current user only
    (whatever the umask: a group-writable entry would be refused when read back)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


def _tree(directory: str) -> list[str]:
    """`directory` and everything in it."""
    paths = []
    for root, dirs, files in os.walk(directory):
        paths += [root, *(os.path.join(root, name) for name in (*dirs, *files))]
    return paths


def unsafe_tree_reason(directory: str) -> str | None:
    """`unsafe_reason` of the first of `directory`'s parent, itself and everything in it that
    another user could have written, or None (a checkpoint directory is read whole)."""
    paths = [os.path.dirname(os.path.abspath(directory)), *_tree(directory)]
    return next((reason for reason in map(unsafe_reason, paths) if reason), None)


def make_tree_private(directory: str) -> None:
    """Takes group and other permissions off `directory` and everything in it (a library that
    writes under the process's umask, e.g. Orbax, leaves them; `unsafe_tree_reason` would then
    refuse what was written)."""
    for path in _tree(directory):
        os.chmod(path, os.lstat(path).st_mode & 0o700)
