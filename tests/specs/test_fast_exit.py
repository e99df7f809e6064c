"""freeze_heap_at_exit: the heap is frozen at exit, not before, and the exit handlers registered after it run first
with the collector intact."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

CODE = """
import atexit, gc
atexit.register(lambda: print("frozen at the end", gc.get_freeze_count() > 0))
from areal_hex_plugin.fast_exit import freeze_heap_at_exit
freeze_heap_at_exit()
freeze_heap_at_exit()
atexit.register(lambda: print("frozen in a later handler", gc.get_freeze_count() > 0))
print("frozen before exit", gc.get_freeze_count() > 0)
"""


def test_the_heap_is_frozen_at_exit_after_the_later_handlers():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True, cwd=REPO)
    assert proc.stdout.splitlines() == [
        "frozen before exit False",
        "frozen in a later handler False",
        "frozen at the end True",
    ]
