"""Data links kept from version to version: no new connection while the route and the links hold, a broken link
rebuilt (never reused), and a kept link that cannot be turned against the node."""

from __future__ import annotations

import contextlib
import secrets
import time

import pytest
import torch

from areal_hex_plugin.transport.buckets import chunk_digest, content_key
from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import PartSender, RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from tests.transport import attacks
from tests.transport.harness import TOKEN, Proxy

pytestmark = pytest.mark.integration


@pytest.fixture
def chain(request):
    """Three nodes in one pool, each behind a proxy that counts (and can cut) the connections to it, and the
    two senders of its versions (over gloo, or the backend the test parametrizes the fixture with)."""
    nodes = [ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=10.0), token=TOKEN) for _ in range(3)]
    proxies = [Proxy(node.start()) for node in nodes]
    senders = _TwoSenders(proxies, getattr(request, "param", "gloo"))
    yield nodes, proxies, senders
    senders.close()
    for proxy in proxies:
        proxy.close()
    for node in nodes:
        node.stop()


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(64, 96, generator=generator) for i in range(8)}


class _TwoSenders:
    """A version in two parts: the coordinator (part 0) and one PartSender kept from version to version."""

    def __init__(self, proxies: list[Proxy], backend: str) -> None:
        route = Route([PoolRoute("h20", [proxy.endpoint for proxy in proxies], 1.5, 5.0)])
        config = SenderConfig(backend=backend, chunk_bytes=16 << 10, timeout_s=10.0)
        self.coordinator = RelaySender(route, config, token=TOKEN, parts=2)
        self.part: PartSender | None = None

    def send(self, version: int, state: dict[str, torch.Tensor]):
        self.coordinator.begin(version)
        assignment = self.coordinator.assignment()
        if self.part is None:
            self.part = PartSender(assignment, 1, token=TOKEN)
        else:
            self.part.begin(assignment)
        items = list(state.items())
        for start in range(0, len(items), 4):  # tensors dealt in turn: part 0 the even ones, part 1 the odd
            self.coordinator.send_bucket(items[start : start + 4 : 2])
            self.part.send_bucket(items[start + 1 : start + 4 : 2])
        summaries = [self.part.finish()]
        while (plan := self.coordinator.settle(summaries)) is not None:
            summaries = [self.part.repair(plan)]
        report = self.coordinator.finish(parts=summaries)
        self.part.release()
        return report

    def close(self) -> None:
        if self.part is not None:
            self.part.close()
        self.coordinator.close()


def _holds(nodes: list[ReceiverNode], state: dict[str, torch.Tensor], version: int) -> bool:
    return all(
        node.version == version
        and node.sink.tensors.keys() == state.keys()
        and all(torch.equal(node.sink.tensors[name], tensor) for name, tensor in state.items())
        for node in nodes
    )


def _connections(proxies: list[Proxy]) -> list[int]:
    return [len(proxy.connections) for proxy in proxies]


@pytest.mark.parametrize("chain", ["gloo", "tcp"], indirect=True)
def test_the_next_version_reuses_every_data_link(chain):
    nodes, proxies, senders = chain
    for version in (1, 2, 3):
        report = senders.send(version, _state(version))
        assert len(report.committed) == 3 and _holds(nodes, _state(version), version)
        # No connection (so no handshake, no gloo rendezvous) after the first version: each node has its
        # control channel and one data link per part from its upstream neighbour, as in version 1.
        assert _connections(proxies) == [3, 3, 3]


def test_a_cut_link_is_rebuilt_and_the_version_still_commits_bit_exact(chain):
    nodes, proxies, senders = chain
    senders.send(1, _state(1))
    for proxy in proxies:  # every data link breaks between versions (connection 0 is the control channel)
        for index in range(1, len(proxy.connections)):
            proxy.cut(index)
    report = senders.send(2, _state(2))
    assert len(report.committed) == 3 and report.failed == {} and _holds(nodes, _state(2), 2)
    assert _connections(proxies) == [5, 5, 5]  # two new data links into every node, nothing else
    senders.send(3, _state(3))  # and the rebuilt links are kept in turn
    assert _connections(proxies) == [5, 5, 5] and _holds(nodes, _state(3), 3)


@pytest.mark.parametrize("chain", ["tcp"], indirect=True)
def test_a_frame_injected_into_a_kept_link_breaks_it_and_the_next_version_rebuilds_it(chain):
    nodes, proxies, senders = chain
    senders.send(1, _state(1))
    # An on-path attacker (no token) slips a bucket frame of its own into the relay's kept data link.
    forged = b'{"kind":"bucket"}'
    proxies[0].connections[1][1].sendall(len(forged).to_bytes(4, "big") + forged + bytes(32))
    assert attacks.closed_by_peer(proxies[0].connections[1][0], within_s=5.0)
    report = senders.send(2, _state(2))
    assert len(report.committed) == 3 and _holds(nodes, _state(2), 2)
    assert _connections(proxies) == [4, 3, 3]  # only the broken link was opened again


def test_a_kept_link_from_a_peer_that_is_no_longer_upstream_delivers_nothing():
    """A token holder that was the relay's upstream in one session keeps its data link open; once the next
    session names another upstream, a bucket it sends there (with valid digests: it holds the token) is refused
    and its link closed."""
    node = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0), token=TOKEN)
    endpoint = node.start()
    control = attacks.TokenHolder(endpoint, TOKEN)
    data = None
    try:
        update = secrets.token_hex(32)
        sessions = [secrets.token_hex(8) for _ in range(2)]
        for version, (session, upstream) in enumerate(
            zip(sessions, ["127.0.0.2", "127.0.0.3"], strict=True), start=1
        ):
            prepare = {"kind": "prepare", "session": session, "update": update, "version": version}
            answer = control.ask({**prepare, "upstream": [upstream], "parts": 1})
            assert answer["t"] == "ready"
            if version == 1:
                data = attacks.TokenHolder(endpoint, TOKEN, role="data", session=session, source="127.0.0.2")
                data.send({"kind": "link", "backend": "tcp"})
                while not node._data:  # the link is open in session 1 before session 2 begins
                    time.sleep(0.01)
        payload = torch.ones(4096, dtype=torch.uint8)
        header = {"kind": "bucket", "session": sessions[1], "version": 2, "index": 0, "copy": 0}
        chunks = [chunk_digest(content_key(TOKEN, update), 0, 0, payload)]
        with contextlib.suppress(OSError):  # the node may hang up at the header already
            data.send(
                {**header, "nbytes": 4096, "chunk": 4096, "manifest": [["w", "uint8", [4096], 0, 4096]]}
            )
            data.sock.sendall(payload.numpy().tobytes())
            data.send(
                {
                    "kind": "digests",
                    **{k: header[k] for k in ("session", "version", "index", "copy")},
                    "chunks": chunks,
                }
            )
        assert data.closed_by_peer(within_s=3.0)
        assert node._session is not None and node._session.digests == {}
    finally:
        if data is not None:
            data.close()
        control.close()
        node.stop()


def test_a_node_restarted_between_versions_gets_new_links_and_the_version(chain):
    nodes, proxies, senders = chain
    senders.send(1, _state(1))
    port = nodes[1].config.port = proxies[1].target.port  # the middle node restarts on its address
    nodes[1].stop()
    nodes[1] = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=10.0, port=port), token=TOKEN)
    nodes[1].start()
    report = senders.send(2, _state(2))
    assert len(report.committed) == 3 and report.failed == {} and _holds(nodes, _state(2), 2)
    # Its control channel, both data links into it and both out of it are new; the relay's are kept.
    assert _connections(proxies) == [3, 6, 5]
