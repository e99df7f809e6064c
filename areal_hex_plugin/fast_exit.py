"""A process exit without the interpreter's last full garbage collections.

At exit CPython clears every module and collects the whole heap: in a process holding torch, transformers and
upstream AReaL (0.6-0.8 M objects) that takes 2-4 s of CPU, past the 3 s that upstream's scheduler gives a worker
between SIGTERM and SIGKILL, so every CPU run ended by force-killing its workers. :func:`freeze_heap_at_exit`
freezes the heap (``gc.freeze``) at exit, once the exit handlers registered after the call ran (those registered
before it run after it; the collector still collects what they make): what reference counting frees is still
freed, the objects in reference cycles go with the process. Python does not promise to finalize objects still
alive at exit (``object.__del__``).
"""

from __future__ import annotations

import atexit
import functools
import gc


@functools.cache
def freeze_heap_at_exit() -> None:
    """Have this process freeze its heap at exit (once, however often called)."""
    atexit.register(gc.freeze)
