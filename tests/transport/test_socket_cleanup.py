"""Failed connection set-ups close their sockets and surface as TransportError (in-process nodes, real
sockets, real gloo link requests)."""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator

import pytest
import torch

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.protocol import Kind
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from areal_hex_plugin.transport.wire import Channel, TransportError
from tests.transport.harness import TOKEN

_STATE = {"model.layers.0.mlp.up_proj.weight": torch.arange(256, dtype=torch.float32).reshape(16, 16)}


class _NoDataNode(ReceiverNode):
    """Authenticates data connections, then hangs up before the link is set up (a replica that cannot)."""

    def _serve_data(self, channel, session) -> None:
        return None


def _node(kind: type[ReceiverNode] = ReceiverNode) -> ReceiverNode:
    node = kind(MemorySink(), ReceiverConfig(timeout_s=5.0), token=TOKEN)
    node.endpoint = node.start()
    return node


@contextlib.contextmanager
def _unclosed_sockets() -> Iterator[list[str]]:
    """Collects the "unclosed socket" warnings of sockets dropped inside the block (ones already dropped are
    collected first); a socket leaked by a failed set-up has lost its peer address, so all are counted."""
    gc.collect()
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield found
        gc.collect()
    found.extend(str(w.message) for w in caught if str(w.message).startswith("unclosed <socket"))


def test_relay_that_refuses_the_data_link_leaves_no_open_socket():
    """A gloo link, like a tcp one, carries its bytes on the data connection: the refusal surfaces when the version
    goes out (the link broke, or the relay made no progress), not at set-up."""
    node = _node(_NoDataNode)
    sender = RelaySender(
        Route([PoolRoute("h20", [node.endpoint], 1.5, 5.0)]), SenderConfig("gloo", timeout_s=2.0), token=TOKEN
    )
    try:
        relay_failed = rf"replica {node.endpoint}: (data link to relay broke|no progress within 2 s)"
        with _unclosed_sockets() as unclosed, pytest.raises(TransportError, match=relay_failed):
            sender.send_version(1, [list(_STATE.items())])
    finally:
        sender.close()
        node.stop()
    assert unclosed == []


def test_node_whose_downstream_refuses_closes_its_socket_and_the_rest_commit():
    head, tail = _node(), _node(_NoDataNode)
    route = Route([PoolRoute("h20", [head.endpoint, tail.endpoint], 1.5, 5.0)])
    # The head's claim that its forward failed does not route the tail out (blame needs proof, sender.py): the
    # tail's stall does, after the no-progress timeout.
    sender = RelaySender(route, SenderConfig("gloo", timeout_s=2.0), token=TOKEN)
    try:
        with _unclosed_sockets() as unclosed:
            report = sender.send_version(1, [list(_STATE.items())])
    finally:
        sender.close()
        head.stop()
        tail.stop()
    assert report.failed == {str(tail.endpoint): "no progress within 2 s"}
    assert report.committed == [str(head.endpoint)]
    assert unclosed == []


def test_control_connection_broken_at_once_is_a_transport_error(monkeypatch):
    node = _node()
    real_send = Channel.send

    def send_breaking_control_hello(channel, message):
        if message.kind == Kind.HELLO:  # the peer reset the connection right after the handshake
            raise BrokenPipeError(32, "Broken pipe")
        real_send(channel, message)

    monkeypatch.setattr(Channel, "send", send_breaking_control_hello)
    sender = RelaySender(Route([PoolRoute("h20", [node.endpoint], 1.5, 5.0)]), SenderConfig(), token=TOKEN)
    try:
        broken = rf"{node.endpoint}: control connection .* broke at once"
        with _unclosed_sockets() as unclosed, pytest.raises(TransportError, match=broken):
            sender.begin(1)
    finally:
        sender.close()
        node.stop()
    assert unclosed == []
