"""Commit in doubt, told as such (issue 37): after the commit deadline or a lost answer the sender asks the replica
what it serves and reports "switched", "kept" or "unknown: check server X", never a guess. Real replica processes
whose sink (their "server") is slow or whose node dies right after the load."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from areal_hex_plugin.transport.node import ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from tests.transport.harness import TOKEN, Replica, ReplicaFleet

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


def _slow_load(node: ReceiverNode) -> None:
    """The server takes longer to load than the commit deadline and the status grace together."""
    load = node.sink.load

    def slow(version, staged) -> None:
        time.sleep(_SLOW_LOAD_S)
        load(version, staged)

    node.sink.load = slow


def _dies_after_load(node: ReceiverNode) -> None:
    """The server loads the version, then the receiver is killed before it can acknowledge."""
    load = node.sink.load

    def load_then_die(version, staged) -> None:
        load(version, staged)
        os.kill(os.getpid(), signal.SIGKILL)

    node.sink.load = load_then_die


def test_a_load_past_the_deadline_is_reported_unknown_not_kept(tmp_path):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (slow,) = fleet.start([1], setup=_slow_load)
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
