"""Commit in doubt, told as such (issue 37): after the commit deadline or a lost answer the sender asks the replica
what it serves and reports "switched", "kept" or "unknown: check server X", never a guess. Real replica processes
whose sink (their "server") is slow or whose node dies right after the load."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from areal_hex_plugin.transport.node import ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from tests.transport.harness import TOKEN, Proxy, Replica, ReplicaFleet

pytestmark = pytest.mark.integration

_SLOW_LOAD_S = 6.0


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=generator) for i in range(2)
    }


def _sender(*replicas: Replica) -> RelaySender:
    route = Route([PoolRoute("h20", [r.endpoint for r in replicas], 1.5, 5.0)])
    return RelaySender(route, SenderConfig(timeout_s=2.0, commit_timeout_s=1.0), token=TOKEN)


def _loads_for(seconds: float):
    """The server takes ``seconds`` to load."""

    def setup(node: ReceiverNode) -> None:
        load = node.sink.load

        def slow(version, staged) -> None:
            time.sleep(seconds)
            load(version, staged)

        node.sink.load = slow

    return setup


def _dies_after_load(node: ReceiverNode) -> None:
    """The server loads the version, then the receiver is killed before it can acknowledge."""
    load = node.sink.load

    def load_then_die(version, staged) -> None:
        load(version, staged)
        os.kill(os.getpid(), signal.SIGKILL)

    node.sink.load = load_then_die


def test_a_load_past_the_deadline_is_reported_unknown_not_kept(tmp_path):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (slow,) = fleet.start([1], setup=_loads_for(_SLOW_LOAD_S))  # past the deadline and the status grace
        sender = _sender(slow)
        try:
            began = time.monotonic()
            report = sender.send_version(1, [list(_state(1).items())])
            reported_after = time.monotonic() - began
        finally:
            sender.close()
        reason = report.failed[str(slow.endpoint)]
        assert report.committed == [] and reported_after < _SLOW_LOAD_S, (reported_after, reason)
        assert reason.startswith("unknown: check server") and "still loading version 1" in reason, reason
        assert report.outcomes == {str(slow.endpoint): reason}
        time.sleep(max(0.0, _SLOW_LOAD_S + 1.0 - reported_after))  # the load has finished by now
        assert slow.committed()["version"] == 1  # it did switch: "will not switch" was a guess


def test_a_receiver_killed_after_its_server_loaded_is_reported_unknown(tmp_path):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (healthy,) = fleet.start([1])
        (dying,) = fleet.start([1], setup=_dies_after_load)
        sender = _sender(healthy, dying)
        try:
            report = sender.send_version(1, [list(_state(1).items())])
        finally:
            sender.close()
        reason = report.failed[str(dying.endpoint)]
        assert report.committed == [str(healthy.endpoint)]
        assert dying.committed()["version"] == 1  # its server holds the new version
        assert reason.startswith("unknown: check server") and "will not switch" not in reason, reason
        assert report.outcomes == {str(dying.endpoint): reason}


def test_a_commit_whose_answer_is_lost_is_asked_again_and_reported_switched(tmp_path):
    """The control connection breaks while the replica loads: the sender asks it over a new connection and
    reports what it serves, "switched", instead of a failure."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1], setup=_loads_for(1.5))
        proxy = Proxy(replica.endpoint)
        route = Route([PoolRoute("h20", [proxy.endpoint], 1.5, 5.0)])
        sender = RelaySender(route, SenderConfig(timeout_s=5.0, commit_timeout_s=5.0), token=TOKEN)
        try:
            sender.begin(1)
            sender.send_bucket(list(_state(1).items()))
            sender.finish(commit=False)
            cutter = threading.Timer(0.5, proxy.cut, args=(0,))  # the first connection is the control one
            cutter.start()
            sender.commit()
            cutter.join()
            report = sender.last_report
        finally:
            sender.close()
            proxy.close()
        assert report.committed == [str(proxy.endpoint)], report.failed
        assert report.outcomes == {str(proxy.endpoint): "switched"}
        assert replica.committed()["version"] == 1
