"""Control replies are matched to their request: a late answer to a timed-out request is not read as the
answer to the next one (in-process receiver nodes on real sockets)."""

from __future__ import annotations

import threading
import time

import torch

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from tests.transport.harness import TOKEN


class _SlowAbortNode(ReceiverNode):
    """Answers its first abort only after the sender has stopped waiting for it."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(MemorySink(), ReceiverConfig(timeout_s=5.0), token=TOKEN)
        self.delay_s, self.slow_aborts = delay_s, threading.Semaphore(1)

    def _on_abort(self, message):
        if self.slow_aborts.acquire(blocking=False):
            time.sleep(self.delay_s)
        return super()._on_abort(message)


def test_late_abort_reply_does_not_fail_the_next_prepare():
    node = _SlowAbortNode(delay_s=1.5)
    route = Route([PoolRoute("h20", [node.start()], 1.5, 5.0)])
    sender = RelaySender(route, SenderConfig(timeout_s=1.0), token=TOKEN)
    state = {"model.layers.0.mlp.up_proj.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8)}
    try:
        sender.begin(1)
        sender.abort()  # times out: the node's "aborted" arrives during the next version's prepare
        report = sender.send_version(2, [list(state.items())])
    finally:
        sender.close()
        node.stop()
    assert report.failed == {} and report.reroutes == 0
    assert report.committed == [str(route.pools[0].replicas[0])]
    assert node.version == 2 and torch.equal(
        node.sink.tensors["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    )
