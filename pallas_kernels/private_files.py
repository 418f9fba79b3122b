# SPDX-License-Identifier: Apache-2.0
"""Which cached files are safe to run as code: those no other local user could have written.

Cached executables are unpickled, the native kernels' library is loaded into the process and
JAX's compilation cache holds machine code, so a file is read only when nobody but the current
user could have written it, or swapped it, or anything above it, once checked. The rule:

- the file and the directory holding it (or a directory judged itself) belong to the current
  user and are writable by nobody else (no group or other write bit);
- every directory above, up to `/`, belongs to root or to the current user, and is writable by
  nobody else unless it has the sticky bit (`/tmp`): there only an entry's owner may rename or
  remove it, and the entry below is itself checked;
- the path is judged where it really is (`os.path.realpath`, as ssh does for its keys), and a
  file is then read through the descriptor that was judged (`open_private_file`: `fstat` of the
  open descriptor, the same file the path check saw), so swapping it after the check is seen.

This is the rule ssh applies to `~/.ssh` and its ancestors (`StrictModes`), with the sticky-bit
exception for shared temporary directories. Anything else is refused with an `UnsafeCacheError`
naming the path and the fix; the caller compiles, builds or loads from the source instead.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO


class UnsafeCacheError(PermissionError):
    """A cache file or directory that another user could have written."""


def _writable_by_others(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def own_reason(path: str, info: os.stat_result | None = None) -> str | None:
    """Why `path` (a cached file or its directory; `info`, its status when known) is not the
    current user's alone, or None. Its ancestors are not judged (`unsafe_reason` does)."""
    info = os.stat(path) if info is None else info
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not by the current user (uid {os.getuid()})"
    if _writable_by_others(info.st_mode):
        return (
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"`chmod go-w {path}` makes it usable"
        )
    return None


def _ancestor_reason(path: str, info: os.stat_result) -> str | None:
    """Why another user could replace what lies below directory `path`, or None."""
    if info.st_uid not in (0, os.getuid()):
        return (
            f"its ancestor {path} is owned by uid {info.st_uid} (neither root nor the current user, "
            f"uid {os.getuid()}), who could replace what lies below; use a cache directory whose "
            "every ancestor belongs to root or to you"
        )
    if _writable_by_others(info.st_mode) and not info.st_mode & stat.S_ISVTX:
        return (
            f"its ancestor {path} is writable by group or others without the sticky bit "
            f"(mode {stat.S_IMODE(info.st_mode):o}), so another user could replace what lies below; "
            f"`chmod go-w {path}` or a cache directory elsewhere makes it usable"
        )
    return None


def ancestors_reason(directory: str) -> str | None:
    """Why another user could replace what lies below `directory` (really there: no symbolic
    links), by replacing it or a directory above it (the module's rule for ancestors), or None."""
    while True:
        reason = _ancestor_reason(directory, os.stat(directory))
        if reason is not None:
            return reason
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


def unsafe_reason(path: str) -> str | None:
    """Why `path` (a cached file or directory) could hold someone else's content, or None when only
    the current user can have written it (the module's rule: a file and its directory, or a
    directory itself, are the current user's alone; every directory above is an ancestor). A
    missing path is not unsafe."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except FileNotFoundError:
        return None
    reason = own_reason(path, info)
    directory = os.path.dirname(real)
    if reason is None and not stat.S_ISDIR(info.st_mode):
        reason = own_reason(directory)
        directory = os.path.dirname(directory)
    return reason or ancestors_reason(directory)


def check_private(path: str) -> os.stat_result:
    """`path`'s status when only the current user can have written it (`unsafe_reason`); else
    raises UnsafeCacheError (FileNotFoundError when it is missing)."""
    reason = unsafe_reason(path)
    if reason is not None:
        raise UnsafeCacheError(f"refusing to load cached data from {path}: {reason}")
    return os.stat(path)


def open_private_file(path: str) -> BinaryIO:
    """`path` opened for reading when only the current user can have written it: the path is
    checked (`check_private`), the file opened, and the open descriptor judged again (`fstat`):
    it must be the file the path check saw, a regular file of the current user's that nobody
    else may write. Read it through the returned file, never by its path again."""
    checked = check_private(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        opened = os.fstat(fd)
        reason = own_reason(path, opened)
        if reason is None and (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
            reason = f"{path} was replaced between its check and its opening"
        if reason is None and not stat.S_ISREG(opened.st_mode):
            reason = f"{path} is not a regular file"
        if reason is not None:
            raise UnsafeCacheError(f"refusing to load cached data from {path}: {reason}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def make_private_dir(path: str) -> None:
    """Creates `path` and any missing parents readable and writable by the current user only,
    whatever the umask (`os.makedirs` would give the parents the umask's mode, and a
    group-writable parent is refused); an existing directory is left as it is (`check_private`
    judges it)."""
    missing = []
    current = os.path.abspath(path)
    while not os.path.isdir(current):
        missing.append(current)
        current = os.path.dirname(current)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made by a concurrent start
            continue
        os.chmod(directory, 0o700)  # the umask may have taken bits off


def open_private(path: str) -> BinaryIO:
    """`path` opened for writing bytes, created readable and writable by the current user only
    (whatever the umask: a group-writable entry would be refused when read back)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
