"""The driver's guard over its run's processes: a worker that dies ends the run, SIGTERM ends it cleanly, and no
process of the run outlives the driver.

Upstream's scheduler starts each worker as a child of the driver (a shell running ``areal.infra.rpc.rpc_server``),
and each worker starts its own (the SGLang servers). :class:`RunGuard`:

- lists the driver's descendants every ``interval_s`` on a thread of its own and remembers each one; a worker
  upstream's scheduler started (``rpc_server``, or the shell it runs in, upstream's handle of it) that is gone
  while the run goes on raises :class:`WorkerDied` in the main thread, so the run ends within about ``interval_s`` (an elastic run
  copes with a lost rollout server, not with a lost worker: its server would go on, out of upstream's reach);
- turns SIGTERM and SIGINT into :class:`RunStopped` in the main thread, so the trainer closes its workers, and a
  failure another thread says (:meth:`RunGuard.fail`: the elastic run finds that no rollout server can serve)
  into :class:`RunFailed`;
- once the run ends, gives the trainer a grace period to close (:data:`GRACE_S`, shorter after a failure), then
  says why the run ended, kills every process of the run it saw and ends the driver (a teardown that hangs on a
  dead worker); after a close it kills whatever is left. The run's processes are the workers and theirs, not the
  driver's own helpers (wandb's service).

Both exceptions derive from :class:`RunEnded`, a ``BaseException`` as ``KeyboardInterrupt`` is, so an
``except Exception`` of upstream's that the signal lands in lets it through.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from areal_hex_plugin.errors import HexError

WORKER = "areal.infra.rpc.rpc_server"
RUN_ENV = "AREAL_HEX_RUN"  # the run's mark in the environment of every process it starts
INTERVAL_S = 1.0
GRACE_S = {"done": 300.0, "failed": 30.0}  # for the trainer to close its workers once the run ends
KILL_WAIT_S = 3.0  # between SIGTERM and SIGKILL for what is left
_RUN_FAILED = signal.SIGUSR2


class RunEnded(BaseException):  # noqa: N818 (an interruption, as KeyboardInterrupt is)
    """The run ends now: ``error`` says why, ``exit_code`` is the driver's."""

    def __init__(self, error: HexError, exit_code: int) -> None:
        super().__init__(error.message)
        self.error, self.exit_code = error, exit_code


class RunFailed(RunEnded):
    """Something the run cannot go on without failed (said from another thread: :meth:`RunGuard.fail`)."""

    def __init__(self, error: HexError) -> None:
        super().__init__(error, 2)


class WorkerDied(RunFailed):
    """A worker of the run is gone while the run goes on."""

    def __init__(self, seen: Seen) -> None:
        error = HexError(
            f"worker {seen.role}",
            f"process {seen.pid} ({seen.role}) is gone while the run goes on",
            "read its log under the run's log folder (<role>.log); the run cannot go on without it",
        )
        super().__init__(error)


class RunStopped(RunEnded):
    """The driver was asked to stop (SIGTERM, SIGINT)."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        error = HexError("run", f"stopped by {name}; its workers were stopped with it", "start it again")
        super().__init__(error, 128 + signum)


@contextmanager
def closed(trainer) -> Iterator:
    """``trainer``, closed at the end of the block; a close that fails after the block failed (upstream's teardown
    calling a dead worker) is reported in one line, not raised over the block's error."""
    try:
        yield trainer
    except BaseException:
        try:
            trainer.close()
        except Exception as error:
            first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
            print(
                f"areal-hex: closing the run's workers after it failed: {first}", file=sys.stderr, flush=True
            )
        raise
    trainer.close()


def _started(proc: psutil.Process) -> float:
    """When ``proc`` started, in a unit no clock step moves: on Linux its start in clock ticks since boot
    (``/proc/<pid>/stat``); psutil's creation time adds a boot time that Linux recomputes from the wall clock, so
    a clock step can move it, and a live worker then reads as another process. Elsewhere psutil's creation time."""
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as stat:
            return float(stat.read().rsplit(b")", 1)[1].split()[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise psutil.NoSuchProcess(proc.pid) from None
        return proc.create_time()


@dataclass(frozen=True)
class Seen:
    """A process of the run as first seen: when it started (:func:`_started`), its command line and, for a
    worker, its role."""

    pid: int
    created: float
    cmdline: str
    role: str | None

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return _started(proc) == self.created and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def _role(cmdline: str) -> str | None:
    """The role of an upstream worker's process (the shell the scheduler started, or the worker in it)."""
    found = re.search(r"--role (\S+)", cmdline) if WORKER in cmdline else None
    return found.group(1) if found else None


class RunGuard:
    """Watches the driver's run; :meth:`install` in the main thread, then :meth:`watch`, :meth:`ending` and
    :meth:`close`."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        # Every process the run starts from now on inherits this mark, also one that leaves the driver's tree.
        self.mark = uuid.uuid4().hex
        os.environ[RUN_ENV] = self.mark
        self.seen: dict[tuple[int, float], Seen] = {}
        self.died: Seen | None = None
        self.failed: RunFailed | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        """Turn SIGTERM and SIGINT into :class:`RunStopped`, and a failure (a worker's death, :meth:`fail`) into
        :class:`RunFailed`."""

        def stopped(signum, frame):
            raise RunStopped(signum)

        def failed(signum, frame):
            raise self.failed

        signal.signal(signal.SIGTERM, stopped)
        signal.signal(signal.SIGINT, stopped)
        signal.signal(_RUN_FAILED, failed)

    def fail(self, error: HexError) -> None:
        """End the run for ``error`` (from any thread): :class:`RunFailed` is raised in the main thread."""
        if self.failed is not None:
            return
        self.failed = RunFailed(error)
        self._last_resort(2, error)  # should the main thread not end the run
        signal.pthread_kill(self._main, _RUN_FAILED)

    def watch(self) -> None:
        """Start the watching thread, having seen the run's workers as they are now."""
        self._scan()
        self._thread = threading.Thread(target=self._watch, name="hex-run-guard", daemon=True)
        self._thread.start()

    def stop_watching(self) -> None:
        """The run ends (its workers now go on purpose): no worker's end is a death any more."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5)

    def ending(self, code: int, error: HexError | None = None) -> None:
        """The run ends with exit ``code`` (``error``: it failed, saying why): if closing it takes longer than its
        grace period, say why it ended, kill every process of the run and exit with ``code``."""
        self.stop_watching()
        self._last_resort(code, error)

    def _last_resort(self, code: int, error: HexError | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        grace_s = GRACE_S["failed" if error else "done"]

        def kill() -> None:
            note = f"areal-hex: the run's workers did not close within {grace_s:.0f} s; killing them"
            print(note, file=sys.stderr, flush=True)
            if error is not None:
                print(f"error: {error.message}", file=sys.stderr, flush=True)
            self.kill_all()
            os._exit(code)

        self._timer = threading.Timer(grace_s, kill)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """After the trainer closed: kill whatever process of the run is left."""
        if self._timer is not None:
            self._timer.cancel()
        self.stop_watching()
        self.kill_all()

    def kill_all(self) -> None:
        """SIGTERM every process of the run still alive, SIGKILL what is left after a moment: each one it saw, and
        each one carrying the run's mark that is not the driver or one of its own helpers (a worker's child that
        a dead worker left to init)."""
        self._scan()
        self._scan_marked()
        left = [seen for seen in self.seen.values() if seen.alive()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for seen in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(seen.pid, sig)
            deadline = time.monotonic() + KILL_WAIT_S
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = [seen for seen in left if seen.alive()]

    def _scan_marked(self) -> None:
        me = psutil.Process()
        try:
            helpers = {me.pid}
            for child in me.children():
                if WORKER not in " ".join(child.cmdline()):
                    helpers |= {child.pid, *(p.pid for p in child.children(recursive=True))}
        except psutil.Error:
            return
        for proc in psutil.process_iter():
            try:
                if proc.pid not in helpers and proc.environ().get(RUN_ENV) == self.mark:
                    self._remember(proc, watched=False)
            except psutil.Error:
                continue

    def _scan(self) -> None:
        """Remember the run's worker processes and theirs: the driver's children that start an upstream worker
        and their descendants (not the driver's own helpers, such as wandb's service). Only the workers upstream's
        scheduler started (its shell, and the worker in it) are watched; a worker that a worker forks for itself
        (upstream's colocated eval-rollout) is its parent's to manage."""
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for child in children:
            try:
                if WORKER not in " ".join(child.cmdline()):
                    continue
                started = {child.pid, *(p.pid for p in child.children())}
                tree = [child, *child.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in tree:
                try:
                    self._remember(proc, watched=proc.pid in started)
                except psutil.Error:
                    continue

    def _remember(self, proc: psutil.Process, watched: bool) -> None:
        """Note ``proc`` as a process of the run (``watched``: with its worker role, if it is a worker)."""
        key = (proc.pid, _started(proc))
        if key not in self.seen:
            cmdline = " ".join(proc.cmdline())
            self.seen[key] = Seen(proc.pid, key[1], cmdline, _role(cmdline) if watched else None)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._scan()
            for seen in list(self.seen.values()):
                if seen.role is not None and not seen.alive() and not self._stop.is_set():
                    self.died, self.failed = seen, WorkerDied(seen)
                    self._last_resort(2, self.failed.error)  # should the main thread not end the run
                    signal.pthread_kill(self._main, _RUN_FAILED)
                    return
