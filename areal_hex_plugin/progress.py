"""Progress on stderr for work that takes more than two seconds: on a terminal a spinner with the elapsed time,
erased when the work ends; in a pipe or a log one line when the work has taken two seconds, one every half
minute after, and one with the time it took (bad input, found before, stays one message)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from areal_hex_plugin.tables import is_terminal

AFTER_S = 2.0
EVERY_S = 30.0  # between a log's lines


@contextmanager
def working(what: str, after_s: float = AFTER_S, every_s: float = EVERY_S) -> Iterator[None]:
    """Show ``what`` (e.g. "planning recipes/paper/7b.yaml") once it has run for ``after_s`` seconds."""
    stream = sys.stderr
    done = threading.Event()
    shown = threading.Event()
    start = time.monotonic()

    def spin() -> None:
        from rich.console import Console

        if done.wait(after_s):
            return
        with Console(file=stream, force_terminal=True).status(what) as status:
            while not done.wait(0.2):
                status.update(f"{what} ({time.monotonic() - start:.0f}s)")

    def log() -> None:
        if done.wait(after_s):
            return
        shown.set()
        print(f"{what} ...", file=stream, flush=True)
        while not done.wait(every_s):
            print(f"{what} ... {time.monotonic() - start:.0f}s", file=stream, flush=True)

    thread = threading.Thread(
        target=spin if is_terminal(stream) else log, name="areal-hex-progress", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if shown.is_set():
        print(f"{what}: done in {time.monotonic() - start:.1f}s", file=stream, flush=True)
