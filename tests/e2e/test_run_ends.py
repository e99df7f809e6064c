"""A run ends, and leaves nothing behind, however it ends: a worker killed mid-run (the driver ends non-zero within a
minute), and SIGTERM to the driver (it stops its workers and exits 128 + 15). Each is the real driver on the CPU
recipe. (The same command run twice, the second resuming from the first's recover checkpoint, is
test_grpo_e2e.py's local run.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("areal")

from tests.e2e.run import environment, new_mark, processes_left, processes_with, run_driver  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
STEPS = 4
GPUS = {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2"}
ENDED_WITHIN_S = 60.0


def _generated(folder: Path) -> bool:
    """Whether a rollout server has answered a request (the run is mid-way: its workers all up)."""
    for log in (folder / "servers").glob("*.jsonl"):
        if any(json.loads(line).get("event") == "generate" for line in log.read_text().splitlines() if line):
            return True
    return False


def _process(mark: str, *words: str) -> int | None:
    """The pid of the run's Python process whose command line holds every one of ``words`` (not the shell that
    upstream's scheduler starts a worker in)."""
    for entry in processes_with(mark):
        pid, cmdline = entry.split(" ", 1)
        if all(word in cmdline for word in words) and not cmdline.startswith("/bin/bash"):
            return int(pid)
    return None


class MidRun(threading.Thread):
    """Once the run generates, sends ``sig`` to its process named by ``words``, and notes when."""

    def __init__(self, folder: Path, mark: str, sig: int, *words: str) -> None:
        super().__init__(daemon=True)
        self.folder, self.mark, self.sig, self.words = folder, mark, sig, words
        self.at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            pid = _process(self.mark, *self.words) if _generated(self.folder) else None
            if pid is not None:
                os.kill(pid, self.sig)
                self.at = time.monotonic()
                return


@pytest.mark.parametrize(
    ("sig", "words", "code", "says"),
    [
        (
            signal.SIGKILL,
            ("areal.infra.rpc.rpc_server", "--role rollout"),
            2,
            "error: worker rollout: process",
        ),
        (
            signal.SIGTERM,
            ("areal_hex_plugin.driver",),
            128 + signal.SIGTERM,
            "error: run: stopped by SIGTERM",
        ),
    ],
    ids=["worker-killed", "driver-sigterm"],
)
def test_a_run_ended_mid_way_ends_within_a_minute_and_leaves_nothing(
    tmp_path: Path, sig: int, words: tuple[str, ...], code: int, says: str
) -> None:
    mark = new_mark()
    env = environment(tmp_path, mark, GPUS)
    start = time.monotonic()
    midway = MidRun(tmp_path, mark, sig, *words)
    midway.start()
    run = run_driver(tmp_path, "hex_local", 20, env, TIMEOUT_S)
    midway.done.set()
    assert midway.at is not None, "the run ended before it generated"
    ended_s = start + run.seconds - midway.at
    assert run.returncode == code, run.log[-6000:]
    assert says in run.log and "Traceback" not in run.log.split(says)[1], run.log[-3000:]
    assert ended_s <= ENDED_WITHIN_S, ended_s
    assert processes_left(mark, wait_s=10) == []
    print(f"\n[e2e ended] {json.dumps({'signal': signal.Signals(sig).name, 'ended_s': round(ended_s, 1)})}")
