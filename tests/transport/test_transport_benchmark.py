"""benchmarks/transport.py on a small machine: it refuses a run that does not fit, reports a worker that dies with
its exit cause and log, and leaves nothing staged in /dev/shm however it ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import transport

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "transport.py"
TINY = [
    "--hidden",
    "256",
    "--layers",
    "1",
    "--vocab",
    "4096",
    "--bucket-mb",
    "1",
    "--digest-repeats",
    "1",
    "--digest-mb",
    "16",
]


def _benchmark(*argv: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen,
    )  # fmt: skip


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_run_that_does_not_fit_is_refused_naming_the_flag_and_what_was_left_staged_is_removed():
    """400 replicas per pool need hundreds of GiB: one message, naming --replicas, before anything starts. A
    staged copy that a run killed from outside left (its pid dead) is removed first."""
    left = transport.SHM / f"{transport.SHM_PREFIX}{_dead_pid()}-left"
    left.mkdir()
    (left / "weights").write_bytes(b"\0" * 4096)
    run = _benchmark("--replicas", "400", "--senders", "")
    out, err = run.communicate(timeout=60)
    assert run.returncode == 1 and out == ""
    assert "not enough memory" in err and "400 replicas per pool" in err and "--replicas" in err, err
    assert "nothing was run" in err and len(err.strip().splitlines()) == 1, err
    assert not left.exists()


def test_a_worker_that_dies_is_reported_with_its_signal_and_its_log_is_kept(tmp_path):
    log = tmp_path / "replica-0-0.log"
    script = "import os, signal, sys; print('staging', file=sys.stderr, flush=True); os.kill(os.getpid(), 9)"
    worker = transport.Worker("replica-0-0", [sys.executable, "-c", script], dict(os.environ), log)
    with pytest.raises(transport.WorkerDied) as died:
        worker.read()
    worker.stop()
    message = str(died.value)
    assert message.startswith("replica-0-0 ended early (SIGKILL: likely the kernel's OOM killer, read `dmesg")
    assert message.endswith(f"its log: {log}")
    assert log.read_text() == "staging\n"


def test_a_worker_that_exits_is_reported_with_its_status(tmp_path):
    worker = transport.Worker(
        "trainer", [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "t.log"
    )
    with pytest.raises(transport.WorkerDied, match=r"^trainer ended early \(exit status 3\)"):
        worker.read()
    worker.stop()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_sigterm_mid_run_removes_every_staged_copy_and_namespace():
    run = _benchmark("--replicas", "2", "--senders", "", "--repeats", "20", *TINY, start_new_session=True)
    staged = []
    deadline = time.monotonic() + 300
    while not staged and time.monotonic() < deadline and run.poll() is None:
        staged = [
            path for path in transport.SHM.glob(f"{transport.SHM_PREFIX}{run.pid}-*/*/*") if path.is_dir()
        ]
        time.sleep(0.2)
    assert staged, "no version was ever staged"
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0 and "stopped by SIGTERM" in err, err[-3000:]
    logs = Path(err.split("the workers' logs are kept in ", 1)[1].split()[0])
    assert (logs / "replicas-2" / "trainer.log").is_file()
    shutil.rmtree(logs)
    assert not list(transport.SHM.glob(f"{transport.SHM_PREFIX}{run.pid}-*"))
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"hxb{run.pid % 10000:04d}-" not in namespaces
