"""Scratch directories a receiver owns while its process lives, and that the next receiver reclaims after it.

A rollout server killed by its scheduler (SIGKILL, the OOM killer) runs no clean-up, and its staged weights would
stay in ``/dev/shm`` or on the rollback disk, one model's worth per killed server, until the machine reboots. Each
directory therefore holds an exclusive ``flock`` on its ``.owner`` file for the life of the process (the kernel
drops it when the process dies, in any pid namespace), and a new directory removes the siblings whose lock is
free. ``.owner`` appears only already locked, so a directory still being created is never taken for an orphan.
Only the process that made a directory removes it: a forked child (a helper that exits the normal way runs the
exit handlers it inherited) leaves its parent's directories alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

logger = logging.getLogger("HexScratch")

PREFIX = "areal-hex-"
_OWNER = ".owner"


class OwnedDir:
    """A fresh ``areal-hex-*`` directory under ``parent``, removed by :meth:`remove` or when the process ends."""

    def __init__(self, parent: Path) -> None:
        parent.mkdir(parents=True, exist_ok=True)
        reclaim_orphans(parent)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        pending = self.path / f"{_OWNER}.{os.getpid()}"
        self._lock = os.open(pending, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
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


def reclaim_orphans(parent: Path) -> list[Path]:
    """Remove the ``areal-hex-*`` directories under ``parent`` whose owning process has died; returns them."""
    removed = []
    for owner in parent.glob(f"{PREFIX}*/{_OWNER}"):
        try:
            fd = os.open(owner, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its process lives
        else:
            shutil.rmtree(owner.parent, ignore_errors=True)
            removed.append(owner.parent)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d stage dir(s) left by killed receivers under %s", len(removed), parent)
    return removed
