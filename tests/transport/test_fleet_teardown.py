"""The test harness's replica fleet leaves no process behind, whatever SIGTERM handler the test process has."""

from __future__ import annotations

import signal

from tests.transport.harness import ReplicaFleet


def test_replicas_end_on_exit_even_when_the_parent_ignores_sigterm(tmp_path):
    # Under xdist a worker may hold Ray's SIGTERM handler; a forked replica inherited it and outlived its test.
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with ReplicaFleet(tmp_path) as fleet:
            processes = [replica.process for replica in fleet.start([1, 1])]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [p.is_alive() for p in processes] == [False, False]
    assert [p.exitcode for p in processes] == [-signal.SIGTERM, -signal.SIGTERM]
