"""Killing one process of an e2e run by its command line (the stand-in server, a worker)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from tests.e2e.run import processes_with


def flag(argv: list[bytes], name: bytes) -> bytes | None:
    """The value after ``name`` in a command line, None when it is not there."""
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def kill_where(mark: str, chosen: Callable[[list[bytes]], bool]) -> bool:
    """SIGKILL every process of the run ``mark`` whose whole command line ``chosen`` accepts; whether one was."""
    killed = False
    for entry in processes_with(mark):
        pid = entry.split(" ", 1)[0]
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if chosen(argv):
            os.kill(int(pid), signal.SIGKILL)
            killed = True
    return killed
