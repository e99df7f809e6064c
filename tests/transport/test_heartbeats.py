"""Heartbeats on control channels (issue 37): a control channel silent for three heartbeats (its peer's host lost,
no FIN or RST) is closed at either end, so a restarted trainer takes over a replica within that bound instead of
being refused until kernel keepalive (about 2 hours); a quiet but live channel stays open. Real replica processes,
real trainer processes, SIGSTOP for a host that went silent."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from tests.transport import attacks
from tests.transport.harness import TOKEN, ReplicaFleet, stop_process, transport_records
from tests.transport.trainers import TrainerProcess, state_of

pytestmark = pytest.mark.integration

HEARTBEAT_S = 0.5
BOUND_S = 3 * HEARTBEAT_S
# What a loaded 2-core machine may add to the bound (scheduling, a handshake, a version of 8 KiB).
SLACK_S = 5.0
LOAD_S = 6.0
LONG_LOAD_S = 10.0


def _sender(*endpoints, **config) -> RelaySender:
    config.setdefault("timeout_s", 10.0)
    route = Route([PoolRoute("h20", list(endpoints), 1.5, 5.0)])
    return RelaySender(route, SenderConfig(heartbeat_s=HEARTBEAT_S, **config), token=TOKEN)


def _records(logger_name: str, monkeypatch) -> list[logging.LogRecord]:
    return transport_records(logger_name, monkeypatch, logging.INFO)


def _loads_slowly(marks: Path, seconds: float):
    """The server takes ``seconds`` to load; it notes in ``marks`` when each load begins and ends (wall clock)."""

    def setup(node: ReceiverNode) -> None:
        load = node.sink.load

        def slow(version, staged) -> None:
            with marks.open("a") as out:
                out.write(f"began {version} {time.time()}\n")
            time.sleep(seconds)
            load(version, staged)
            with marks.open("a") as out:
                out.write(f"loaded {version} {time.time()}\n")

        node.sink.load = slow

    return setup


def _marked(marks: Path, event: str, version: int, within_s: float) -> float:
    """When the replica noted ``event`` of ``version`` (waiting up to ``within_s`` for it)."""
    deadline = time.monotonic() + within_s
    while True:
        lines = marks.read_text().splitlines() if marks.exists() else []
        for line in lines:
            name, noted, at = line.split()
            if (name, int(noted)) == (event, version):
                return float(at)
        if time.monotonic() >= deadline:
            raise AssertionError(f"the replica did not note {event} {version} within {within_s:g} s")
        time.sleep(0.05)


def test_a_restarted_trainer_takes_over_from_a_stopped_one_within_three_heartbeats(tmp_path):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1])
        with TrainerProcess([replica.endpoint], heartbeat_s=HEARTBEAT_S, timeout_s=10.0) as lost:
            assert lost.send(1) == [str(replica.endpoint)]
            stop_process(lost.pid)  # its host is gone: no FIN, no RST, its socket stays open
            stopped = time.monotonic()
            sender = _sender(replica.endpoint)
            try:
                report = sender.send_version(2, [list(state_of(2).items())])
            finally:
                sender.close()
            took = time.monotonic() - stopped
        assert report.committed == [str(replica.endpoint)], report.failed
        assert took <= BOUND_S + SLACK_S, f"took over after {took:.1f} s"
        assert replica.committed()["version"] == 2


def test_the_node_closes_a_silent_control_channel_within_three_heartbeats(monkeypatch):
    records = _records("HexTransportNode", monkeypatch)
    node = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0), token=TOKEN)
    endpoint = node.start()
    try:
        silent = attacks.TokenHolder(endpoint, TOKEN, heartbeat_ms=int(HEARTBEAT_S * 1000))
        opened = time.monotonic()
        try:
            assert silent.closed_by_peer(BOUND_S + SLACK_S)
            took = time.monotonic() - opened
        finally:
            silent.close()
    finally:
        node.stop()
    assert BOUND_S * 0.9 <= took <= BOUND_S + SLACK_S, f"closed after {took:.1f} s"
    silences = [r for r in records if "silent" in r.getMessage()]
    assert len(silences) == 1, [r.getMessage() for r in records]


def test_the_trainer_closes_the_control_channel_of_a_stopped_replica_within_three_heartbeats(
    tmp_path, monkeypatch
):
    records = _records("HexTransportSender", monkeypatch)
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        healthy, stopped = fleet.start([1, 1])
        sender = _sender(healthy.endpoint, stopped.endpoint)
        try:
            assert len(sender.send_version(1, [list(state_of(1).items())]).committed) == 2
            control = sender._pools["h20"].controls[stopped.endpoint]
            stop_process(stopped.process.pid)
            began = time.monotonic()
            while not control.lost and time.monotonic() - began < BOUND_S + SLACK_S:
                time.sleep(0.05)
            took, lost = time.monotonic() - began, control.lost
            os.kill(stopped.process.pid, signal.SIGCONT)
        finally:
            sender.close()
    assert lost and took <= BOUND_S + SLACK_S, f"lost: {lost} after {took:.1f} s"
    silences = [r for r in records if "silent" in r.getMessage()]
    assert len(silences) == 1, [r.getMessage() for r in records]


def test_a_quiet_trainer_keeps_its_control_channel_past_the_silence_bound(tmp_path):
    """Idle between versions for four times the bound, each end hears the other's heartbeats: the next version goes
    over the same control channel (and its kept links)."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1])
        sender = _sender(replica.endpoint)
        try:
            assert sender.send_version(1, [list(state_of(1).items())]).committed == [str(replica.endpoint)]
            control = sender._pools["h20"].controls[replica.endpoint]
            time.sleep(4 * BOUND_S)  # the idle time between two versions
            assert not control.lost
            assert sender.send_version(2, [list(state_of(2).items())]).committed == [str(replica.endpoint)]
            assert sender._pools["h20"].controls[replica.endpoint] is control and not control.lost
        finally:
            sender.close()


def test_a_trainer_waiting_for_the_old_channels_bound_is_kept_alive_by_the_node(tmp_path):
    """The open control channel beats every second (so the node waits 3 s for its silence) and goes silent; a new
    trainer that beats every 0.5 s (it gives up on a node silent for 1.5 s) connects meanwhile. The node beats on
    the waiting channel too, so the new trainer takes over once the old channel's bound is over, and commits."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1])
        old = attacks.TokenHolder(replica.endpoint, TOKEN, heartbeat_ms=1000)  # silent from now on
        try:
            opened = time.monotonic()
            sender = _sender(replica.endpoint)
            try:
                report = sender.send_version(1, [list(state_of(1).items())])
            finally:
                sender.close()
            took = time.monotonic() - opened
        finally:
            old.close()
        assert report.committed == [str(replica.endpoint)], report.failed
        assert 3.0 * 0.9 <= took <= 3.0 + SLACK_S, f"took over after {took:.1f} s"
        assert replica.committed()["version"] == 1


def test_a_trainer_lost_during_a_long_load_is_taken_over_once_silent_and_the_load_finishes_first(tmp_path):
    """The trainer's host goes silent while the replica loads its version for 6 s: the node closes that control
    channel after three heartbeats, not after the load, so a restarted trainer takes over; the node prepares the
    new trainer's version only once the load is done (never beside it), and the version commits."""
    marks = tmp_path / "loads.txt"
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1], setup=_loads_slowly(marks, LOAD_S))
        config = {"heartbeat_s": HEARTBEAT_S, "timeout_s": 10.0, "commit_timeout_s": 60.0}
        with TrainerProcess([replica.endpoint], **config) as lost:
            lost.ask(1)
            _marked(marks, "began", 1, within_s=30.0)
            stop_process(lost.pid)  # its host is gone while the replica loads its version
            sender = _sender(replica.endpoint, timeout_s=LOAD_S + SLACK_S)
            try:
                asked_at = time.time()
                report = sender.send_version(2, [list(state_of(2).items())])
            finally:
                sender.close()
        assert report.committed == [str(replica.endpoint)], report.failed
        assert asked_at + report.phases["prepared"] >= _marked(marks, "loaded", 1, within_s=0.0)
        assert replica.committed()["version"] == 2


def test_a_node_keeps_beating_while_it_loads(tmp_path):
    """A load twice as long as the silence bound: the node beats meanwhile, so the trainer keeps the control
    channel and hears the commit's answer itself (no commit in doubt)."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1], setup=_loads_slowly(tmp_path / "loads.txt", 2 * BOUND_S))
        sender = _sender(replica.endpoint, commit_timeout_s=30.0)
        try:
            sender.begin(1)
            sender.send_bucket(list(state_of(1).items()))
            control = sender._pools["h20"].controls[replica.endpoint]
            report = sender.finish()
            assert sender._pools["h20"].controls[replica.endpoint] is control and not control.lost
        finally:
            sender.close()
        assert report.committed == [str(replica.endpoint)] and report.outcomes == {}, report.failed
        assert replica.committed()["version"] == 1


def test_a_trainer_silent_behind_a_long_load_is_cut_off_within_three_heartbeats(tmp_path):
    """The load takes 10 s, past the commit's deadline: the trainer reports it in doubt; then a trainer asks for
    the next version (which waits for the load) and goes silent. The node still hears that channel while the
    request waits: it closes it after three heartbeats, so a restarted trainer takes over before the load ends,
    and commits."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1], setup=_loads_slowly(tmp_path / "loads.txt", LONG_LOAD_S))
        first = _sender(replica.endpoint, commit_timeout_s=0.5, timeout_s=20.0)
        try:
            report = first.send_version(1, [list(state_of(1).items())])
        finally:
            first.close()
        assert "still loading version 1" in report.outcomes[str(replica.endpoint)], report.outcomes
        silent = attacks.TokenHolder(replica.endpoint, TOKEN, heartbeat_ms=int(HEARTBEAT_S * 1000))
        try:
            prepare = {"session": "b" * 16, "update": "0" * 64, "version": 2, "upstream": [""], "parts": 1}
            silent.send({"kind": "prepare", "id": 1, **prepare})  # and nothing more, not even a heartbeat
            sender = _sender(replica.endpoint, timeout_s=20.0)
            try:
                report = sender.send_version(2, [list(state_of(2).items())])
            finally:
                sender.close()
        finally:
            silent.close()
        assert report.committed == [str(replica.endpoint)], report.failed
        assert replica.committed()["version"] == 2
