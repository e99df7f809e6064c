"""The run guard on real processes: a worker's death reaches the main thread, a spared role's does not, and
nothing the guard saw outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from areal_hex_plugin.areal.run_guard import WORKER, RunGuard, RunStopped, Seen, WorkerDied, closed


def _worker(role: str) -> subprocess.Popen:
    """A process whose command line reads as upstream's worker of ``role``, with a child of its own."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    code += " time.sleep(600)"
    return subprocess.Popen([sys.executable, "-c", code, "areal.infra.rpc.rpc_server", "--role", role])


@pytest.fixture
def guard(monkeypatch):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    monkeypatch.delenv("AREAL_HEX_RUN", raising=False)  # the guard's mark goes with the test
    made = RunGuard(interval_s=0.1)
    made.install()
    yield made
    made.close()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _marked(proc: psutil.Process, mark: str) -> bool:
    try:
        return proc.environ().get("AREAL_HEX_RUN") == mark and proc.pid != os.getpid()
    except psutil.Error:
        return False


def _until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _seen_all(guard: RunGuard, count: int) -> None:
    """Until the guard has seen ``count`` processes (the workers and their children started)."""
    _until(lambda: len(guard.seen) == count)


def _wait_for_exception(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _forked_worker(role: str) -> subprocess.Popen:
    """A shell-like process that runs upstream's worker of ``role``, which forks a worker of its own (as upstream's
    colocated eval-rollout is forked) two levels down."""
    inner = "import time; time.sleep(600)"
    fork = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {inner!r}, '{WORKER}', '--role', 'eval-rollout']); time.sleep(600)"
    worker = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {fork!r}]); time.sleep(600)"
    )
    return subprocess.Popen([sys.executable, "-c", worker, WORKER, "--role", role])


def test_a_dead_worker_ends_the_run_and_a_dead_child_of_one_does_not(guard) -> None:
    actor, rollout = _worker("actor"), _forked_worker("rollout")
    guard.watch()
    _seen_all(guard, 5)  # the actor and its child; the rollout worker, its child and the worker that forked
    forked = next(s for s in guard.seen.values() if s.cmdline.endswith("--role eval-rollout"))
    assert forked.role is None  # its parent's to manage
    os.kill(forked.pid, signal.SIGKILL)
    (server,) = psutil.Process(rollout.pid).children()  # as a rollout worker's SGLang server
    server.kill()
    _wait_for_exception(
        1.0
    )  # no exception: a lost server is the elastic run's to handle, a forked worker too
    rollout.kill()
    rollout.wait()
    with pytest.raises(WorkerDied, match=r"process \d+ \(rollout\) is gone"):
        _wait_for_exception(5.0)
    assert guard.died.role == "rollout"
    actor.kill()
    actor.wait()


def test_a_clock_step_does_not_kill_a_live_worker(guard, monkeypatch) -> None:
    """psutil's creation time is the boot time plus ticks since boot, and Linux recomputes the boot time from the
    wall clock: a clock step (NTP) moves it by seconds. A live worker is still alive then (a CI run under load
    ended a healthy run: "process ... (actor) is gone while the run goes on", while upstream still used it)."""
    actor = _worker("actor")
    try:
        guard.watch()
        _seen_all(guard, 2)
        stepped = psutil._pslinux.boot_time() + 1.0
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
        assert all(seen.alive() for seen in guard.seen.values())
        _wait_for_exception(1.0)  # the watcher's rounds see it alive too
        assert guard.died is None
    finally:
        actor.kill()
        actor.wait()
        guard.stop_watching()


def test_nothing_the_guard_saw_outlives_it_but_the_drivers_own_helpers_do(guard) -> None:
    workers = [_worker("actor"), _worker("rollout")]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # as wandb's service
    try:
        guard.watch()
        _seen_all(guard, 4)
        seen = [s.pid for s in guard.seen.values()]
        assert len(seen) == 4 and helper.pid not in seen  # each worker and its child
        assert sorted(str(s.role) for s in guard.seen.values()) == ["None", "None", "actor", "rollout"]
        # A worker's child that leaves the tree (its parent gone) is still the run's: it carries the run's mark.
        orphan = subprocess.Popen(
            [sys.executable, "-c", "import os, time; os.fork() or time.sleep(600)"], env={**os.environ}
        )
        orphan.wait()  # the forked child sleeps on, its parent gone: init's now
        guard.ending(0)
        guard.close()
        for worker in workers:
            worker.wait(timeout=10)
        marked = [p for p in psutil.process_iter() if _marked(p, guard.mark) and p.pid != helper.pid]
        assert marked == [], [(p.cmdline(), p.ppid(), p.status()) for p in marked]
        assert not [
            pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
        ]
        assert helper.poll() is None
    finally:
        helper.kill()
        helper.wait()


class _Trainer:
    def __init__(self, fails: bool) -> None:
        self.fails, self.closed = fails, 0

    def close(self) -> None:
        self.closed += 1
        if self.fails:
            raise ConnectionError("Cannot connect to host 192.0.2.2:18666\nmore")


def test_a_close_that_fails_after_the_run_failed_does_not_hide_why_it_failed(capsys) -> None:
    trainer = _Trainer(fails=True)
    with pytest.raises(WorkerDied), closed(trainer):
        raise WorkerDied(Seen(1, 0.0, "python -m areal.infra.rpc.rpc_server --role actor", "actor"))
    assert trainer.closed == 1
    assert capsys.readouterr().err == (
        "areal-hex: closing the run's workers after it failed: Cannot connect to host 192.0.2.2:18666\n"
    )
    with pytest.raises(ConnectionError), closed(_Trainer(fails=True)):
        pass  # the run went well: a close that fails is the error
    with closed(ok := _Trainer(fails=False)):
        pass
    assert ok.closed == 1


def test_sigterm_becomes_run_stopped_with_its_exit_code(guard) -> None:
    with pytest.raises(RunStopped) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_exception(5.0)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in stopped.value.error.message
    assert not isinstance(stopped.value, Exception)  # through upstream's `except Exception` handlers


def test_a_failure_said_from_another_thread_ends_the_run_in_the_main_thread(guard) -> None:
    """The elastic run's watcher says no rollout server can serve: the main thread (upstream's loop, waiting for
    rollouts) gets RunFailed with that error, through upstream's ``except Exception``."""
    import threading

    from areal_hex_plugin.areal.run_guard import RunFailed
    from areal_hex_plugin.errors import HexError

    error = HexError("rollout servers", "none serves", "restart the machine")
    with pytest.raises(RunFailed) as failed:
        threading.Thread(target=guard.fail, args=(error,)).start()
        try:
            _wait_for_exception(5.0)
        except Exception:  # noqa: S110 (upstream's handlers let it through)
            pytest.fail("RunFailed must not be an Exception")
    assert failed.value.error is error and failed.value.exit_code == 2
    assert not isinstance(failed.value, WorkerDied)
