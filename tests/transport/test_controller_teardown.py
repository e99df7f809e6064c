"""Teardown: the controller stops every replica's receiver once, through upstream's engine RPC."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("areal")


class _RecordingScheduler:
    """Stands in for upstream's scheduler at the RPC boundary: records each engine call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    async def async_call_engine(self, worker_id, method, engine_name=None, **kwargs):
        self.calls.append((worker_id, method, engine_name))
        return None


def test_stop_receivers_calls_every_engine_once_then_nothing():
    from areal_hex_plugin.transport.controller_adapter import HexPPOActorController

    scheduler = _RecordingScheduler()
    controller = HexPPOActorController.__new__(HexPPOActorController)
    controller.rollout = SimpleNamespace(
        workers=[SimpleNamespace(id="w0"), SimpleNamespace(id="w1")],
        scheduler=scheduler,
        _engine_name=lambda rank: f"rollout/{rank}",
    )
    controller.stop_receivers()  # never started: nothing to stop
    assert scheduler.calls == []
    controller._hex_route = object()  # receivers were started by the first update
    controller.stop_receivers()
    controller.stop_receivers()
    assert scheduler.calls == [
        ("w0", "hex_stop_receiver", "rollout/0"),
        ("w1", "hex_stop_receiver", "rollout/1"),
    ]
