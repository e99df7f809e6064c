"""Scratch directories a receiver owns while its process lives, and that the next receiver reclaims after it.

A rollout server killed by its scheduler (SIGKILL, the OOM killer) runs no clean-up, and its staged weights would
stay in ``/dev/shm`` or on the rollback disk, one model's worth per killed server, until the machine reboots. Each
directory therefore holds an exclusive ``flock`` on its ``.owner`` file for the life of the process (the kernel
drops it when the process dies, in any pid namespace), and a new directory removes the siblings whose lock is
free. ``.owner`` appears only already locked, so a directory still being created is never taken for an orphan.
Only the process that made a directory removes it: a forked child (a helper that exits the normal way runs the
exit handlers it inherited) leaves its parent's directories alone.

Nobody else can own them: the directories live in a per-user parent, ``<shared>/areal-hex-uid<uid>`` (the shared
dir is e.g. ``/dev/shm``), made with mode 0700 and checked at every start (:func:`private_parent`). So no other
user can rename, replace or add anything under it: what a node stages there is what its server loads. Orphans are
reclaimed through directory descriptors, never following a link, and their ``.owner`` is opened without blocking
and read only when it is a regular file.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path

from areal_hex_plugin.errors import HexError

logger = logging.getLogger("HexScratch")

PREFIX = "areal-hex-"
_OWNER = ".owner"
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class OwnedDir:
    """A fresh ``areal-hex-*`` directory in this user's private parent under ``shared`` (``setting`` names the
    option that chose ``shared``, for errors), removed by :meth:`remove` or when the process ends."""

    def __init__(self, shared: Path, setting: str) -> None:
        parent = private_parent(shared, setting)
        reclaim_orphans(parent)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        pending = self.path / f"{_OWNER}.{os.getpid()}"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        self._lock = os.open(pending, flags, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(pending, self.path / _OWNER)
        self._finalizer = weakref.finalize(self, _remove, self.path, self._lock, os.getpid())

    def remove(self) -> None:
        self._finalizer()


def _remove(path: Path, lock: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked child: the directory and its lock are the parent's
        return
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock)


def private_parent(shared: Path, setting: str) -> Path:
    """``<shared>/areal-hex-uid<uid>``, this user's parent of its stage dirs, made here (mode 0700) if missing.

    Refused, naming the path and the fix: a ``shared`` that another user could change (it, or a directory above
    it, is neither this user's nor root's, or others may write it and it is not sticky), and a parent that is not
    this user's private directory (another user made it first, a link, group or other bits set). Returned resolved,
    so no link on the way can be re-pointed after the check."""
    shared.mkdir(parents=True, exist_ok=True, mode=0o700)
    real = Path(os.path.realpath(shared))
    for directory in (real, *real.parents):
        _check_shared(directory, setting)
    parent = real / f"areal-hex-uid{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(parent, 0o700)
    _check_private(parent, setting)
    return parent


def _check_shared(directory: Path, setting: str) -> None:
    """Only this user and root may rename what is in ``directory``."""
    info = os.stat(directory)
    mode = stat.S_IMODE(info.st_mode)
    others_write = mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX
    if info.st_uid not in (0, os.geteuid()) or others_write:
        raise HexError(
            setting,
            f"{directory} (owner uid {info.st_uid}, mode {mode:o}) lets another user replace what is staged "
            "under it",
            f"remove {directory} if another user made it, or point {setting} at a directory only this user or "
            "root can change (e.g. /dev/shm or /var/tmp: the node makes its own private directory there)",
        )


def _check_private(parent: Path, setting: str) -> None:
    info = os.lstat(parent)
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not mode & 0o077:
        return
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        found = "a link" if stat.S_ISLNK(info.st_mode) else "not a directory"
    else:
        found = f"owner uid {info.st_uid}, mode {mode:o}"
    raise HexError(
        setting,
        f"{parent} is not this user's private directory ({found}; another user may have made it first)",
        f"remove it (rm -rf {parent}) and start again: the node makes it with mode 0700; or point {setting} "
        "elsewhere",
    )


def reclaim_orphans(parent: Path) -> list[Path]:
    """Remove the ``areal-hex-*`` directories under ``parent`` whose owning process has died; returns them."""
    removed = []
    parent_fd = os.open(parent, _DIRECTORY)
    try:
        for name in os.listdir(parent_fd):
            owner = _owner_if_orphaned(parent, parent_fd, name) if name.startswith(PREFIX) else None
            if owner is not None:
                try:
                    shutil.rmtree(name, ignore_errors=True, dir_fd=parent_fd)
                finally:
                    os.close(owner)
                removed.append(parent / name)
    finally:
        os.close(parent_fd)
    if removed:
        logger.info("removed %d stage dir(s) left by killed receivers under %s", len(removed), parent)
    return removed


def _owner_if_orphaned(parent: Path, parent_fd: int, name: str) -> int | None:
    """The ``.owner`` of directory ``name``, locked by this call, when its process has died; else None (it
    lives, is still being made, or is not a stage dir: a link, a file, an owner that is no regular file)."""
    try:
        directory = os.open(name, _DIRECTORY, dir_fd=parent_fd)
    except OSError:
        return None  # removed meanwhile, a link or not a directory
    try:
        owner = os.open(_OWNER, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError:
        return None  # being made, removed meanwhile, or a link
    finally:
        os.close(directory)
    if not stat.S_ISREG(os.fstat(owner).st_mode):
        logger.warning("%s is not a regular file: %s is left alone", parent / name / _OWNER, parent / name)
    else:
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return owner
        except BlockingIOError:
            pass  # its process lives
    os.close(owner)
    return None
