"""Progress on stderr for work that takes more than a second: a spinner with the elapsed time, on a terminal
only, erased when the work ends (a pipe or a log gets nothing, and bad input stays one message)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from areal_hex_plugin.tables import is_terminal

AFTER_S = 1.0


@contextmanager
def working(what: str, after_s: float = AFTER_S) -> Iterator[None]:
    """Show ``what`` (e.g. "planning recipes/paper/7b.yaml") once it has run for ``after_s`` seconds."""
    stream = sys.stderr
    if not is_terminal(stream):
        yield
        return
    from rich.console import Console

    done = threading.Event()
    start = time.monotonic()

    def watch() -> None:
        if done.wait(after_s):
            return
        with Console(file=stream, force_terminal=True).status(what) as status:
            while not done.wait(0.2):
                status.update(f"{what} ({time.monotonic() - start:.0f}s)")

    thread = threading.Thread(target=watch, name="areal-hex-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
