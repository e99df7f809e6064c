"""Blame with proof (issue 37): a replica that reports what it cannot observe, or stalls its downstream while
acknowledging at full speed, is the one routed out, never the healthy replica it names. Real replica processes
(one of them turned attacker in its own process), the real sender, loopback sockets."""

from __future__ import annotations

import time

import pytest
import torch

from areal_hex_plugin.transport import node as node_module
from areal_hex_plugin.transport.node import ReceiverNode
from areal_hex_plugin.transport.protocol import FIELDS, Kind, make
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from tests.transport.harness import TOKEN, Replica, ReplicaFleet

pytestmark = pytest.mark.integration


def _state(seed: int, tensors: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=generator)
        for i in range(tensors)
    }


def _one_per_bucket(state: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    return [[item] for item in state.items()]


def _holds(replica: Replica, state: dict[str, torch.Tensor], version: int) -> bool:
    committed = replica.committed()
    return committed["version"] == version and all(
        torch.equal(committed["shards"][0][name], tensor) for name, tensor in state.items()
    )


def _sender(*replicas: Replica, **config) -> RelaySender:
    config.setdefault("timeout_s", 5.0)
    route = Route([PoolRoute("h20", [r.endpoint for r in replicas], 1.5, 5.0)])
    return RelaySender(route, SenderConfig(chunk_bytes=4096, **config), token=TOKEN)


def _nack(session: str, index: int, copy: int) -> dict:
    """A NACK with whatever evidence the schema asks for, made up (the liar received nothing)."""
    made_up = {"received": 8192, "digest": "0" * 64}
    base = {"session": session, "index": index, "copy": copy, "ok": False, "error": ""}
    return {**base, **{name: made_up[name] for name in FIELDS[Kind.ACK] if name not in base}}


# -- attackers, each set up inside its replica's process -------------------------------------------------


def _blames_its_upstream(upstream: str):
    """A tail that, after every bucket, reports that its forward to ``upstream`` failed (it forwards nothing)."""

    def setup(node: ReceiverNode) -> None:
        receive = node._receive_bucket

        def lying(session, header, channel, link) -> None:
            receive(session, header, channel, link)
            node._report(make(Kind.FORWARD_FAILED, session=session.id, peer=upstream, error="made up"))

        node._receive_bucket = lying

    return setup


def _nacks_before_it_is_sent(node: ReceiverNode) -> None:
    """At every prepare, NACKs copies 0 to 3 of bucket 0 before any byte of it was sent anywhere."""
    prepare = node._on_prepare

    def lying(message):
        reply = prepare(message)
        for copy in range(4):
            node._report(make(Kind.ACK, **_nack(message["session"], 0, copy)))
        return reply

    node._on_prepare = lying


def _trickles_downstream(node: ReceiverNode) -> None:
    """Receives and acknowledges at full speed, forwards 512 bytes a second."""
    forward = node_module._Forwarder._forward

    def trickle(self, kind, payload) -> None:
        if kind != "chunk":
            return forward(self, kind, payload)
        flat = payload.reshape(-1)
        for start in range(0, flat.numel(), 512):
            if self.broken:
                return
            forward(self, kind, flat[start : start + 512])
            time.sleep(1.0)

    node_module._Forwarder._forward = trickle


def _claims_its_forward_to(downstream: str):
    """A middle that forwards every bucket whole, then reports that its forward to ``downstream`` (its real
    downstream) failed."""

    def setup(node: ReceiverNode) -> None:
        receive = node._receive_bucket

        def lying(session, header, channel, link) -> None:
            receive(session, header, channel, link)
            node._report(make(Kind.FORWARD_FAILED, session=session.id, peer=downstream, error="made up"))

        node._receive_bucket = lying

    return setup


def _corrupts_downstream(node: ReceiverNode) -> None:
    """Receives (and acknowledges) every bucket whole, forwards each chunk with its first byte flipped."""
    forward = node_module._Forwarder._forward

    def corrupt(self, kind, payload) -> None:
        if kind == "chunk":
            payload = payload.reshape(-1).view(torch.uint8).clone()
            payload[0] ^= 0xFF
        forward(self, kind, payload)

    node_module._Forwarder._forward = corrupt


def _trickles_and_hides_it(node: ReceiverNode) -> None:
    """Trickles downstream as :func:`_trickles_downstream`, and its status says it holds nothing to forward."""
    _trickles_downstream(node)
    data_path = node._data_path
    node._data_path = lambda: {**data_path(), "backlog": 0}


# -- tests ---------------------------------------------------------------------------------------------------


def test_a_tail_that_blames_its_upstream_is_the_one_routed_out(tmp_path):
    """The tail has no downstream: its FORWARD_FAILED naming the relay is a lie the sender can see. It, not the
    relay, is routed out, and stays out for the sender's later versions."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (relay,) = fleet.start([1])
        (tail,) = fleet.start([1], setup=_blames_its_upstream(str(relay.endpoint)))
        sender = _sender(relay, tail)
        try:
            first = sender.send_version(1, _one_per_bucket(_state(1)))
            second = sender.send_version(2, _one_per_bucket(_state(2)))
        finally:
            sender.close()
        assert first.committed == [str(relay.endpoint)], first.failed
        assert "it has no downstream" in first.failed[str(tail.endpoint)]
        assert second.committed == [str(relay.endpoint)], second.failed
        assert "excluded" in second.failed[str(tail.endpoint)]
        assert _holds(relay, _state(2), 2)
        assert tail.committed()["version"] == -1


def test_nacks_for_copies_never_sent_route_out_the_liar_not_its_victims(tmp_path):
    """The tail NACKs copies 0-3 of bucket 0 before any was sent: copies never sent are provably not corrupted
    at it, so it is routed out; the relay and the middle commit."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        healthy = fleet.start([1, 1])
        (liar,) = fleet.start([1], setup=_nacks_before_it_is_sent)
        sender = _sender(*healthy, liar)
        try:
            report = sender.send_version(1, _one_per_bucket(_state(3)))
        finally:
            sender.close()
        assert sorted(report.committed) == sorted(str(r.endpoint) for r in healthy), report.failed
        assert "never sent" in report.failed[str(liar.endpoint)]
        assert all(_holds(replica, _state(3), 1) for replica in healthy)
        assert liar.committed()["version"] == -1


def test_a_middle_that_trickles_downstream_is_routed_out_not_its_tail(tmp_path):
    """The middle acknowledges every bucket at once but forwards 512 B/s (inside every timeout): both ends of its
    link to the tail show where the bytes stop (the middle holds them, its socket and the tail are idle), so the
    middle is routed out and the tail commits."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (relay,) = fleet.start([1])
        (middle,) = fleet.start([1], setup=_trickles_downstream)
        (tail,) = fleet.start([1])
        sender = _sender(relay, middle, tail, timeout_s=3.0)
        try:
            report = sender.send_version(1, _one_per_bucket(_state(4, tensors=2)))
        finally:
            sender.close()
        assert sorted(report.committed) == sorted([str(relay.endpoint), str(tail.endpoint)]), report.failed
        assert "stalled" in report.failed[str(middle.endpoint)]
        assert _holds(relay, _state(4, tensors=2), 1) and _holds(tail, _state(4, tensors=2), 1)


def test_a_middle_that_claims_its_forward_failed_while_its_tail_gets_everything_is_routed_out(tmp_path):
    """The middle forwards every bucket, then says the forward to its tail failed: the tail's own
    acknowledgements (each with the digest of the right bytes, which only came through the middle) refute it.
    The liar is routed out and excluded; the tail, which never said its link broke, commits."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        relay, tail = fleet.start([1, 1])
        (middle,) = fleet.start([1], setup=_claims_its_forward_to(str(tail.endpoint)))
        sender = _sender(relay, middle, tail)
        try:
            report = sender.send_version(1, _one_per_bucket(_state(5)))
        finally:
            sender.close()
        assert sorted(report.committed) == sorted([str(relay.endpoint), str(tail.endpoint)]), report.failed
        assert "excluded" in report.failed[str(middle.endpoint)], report.failed
        assert _holds(relay, _state(5), 1) and _holds(tail, _state(5), 1)
        assert middle.committed()["version"] == -1


def test_a_middle_that_corrupts_what_it_forwards_does_not_get_its_tail_routed_out(tmp_path):
    """The middle acknowledges every bucket (it holds the right bytes) and forwards them corrupted; the tail's
    NACKs are honest. Who corrupted the bytes on that link is not provable, so its ends are separated (the tail
    is fed by the sender, the middle feeds nobody): every replica commits the right bytes, this version and the
    next, which keeps the separated order."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (relay,) = fleet.start([1])
        (middle,) = fleet.start([1], setup=_corrupts_downstream)
        (tail,) = fleet.start([1])
        everyone = sorted(str(r.endpoint) for r in (relay, middle, tail))
        sender = _sender(relay, middle, tail)
        try:
            first = sender.send_version(1, _one_per_bucket(_state(6)))
            second = sender.send_version(2, _one_per_bucket(_state(7)))
        finally:
            sender.close()
        assert sorted(first.committed) == everyone, first.failed
        assert sorted(second.committed) == everyone and second.resent_buckets == 0, second.failed
        assert all(_holds(replica, _state(7), 2) for replica in (relay, middle, tail))


def test_a_trickling_middle_that_hides_its_backlog_does_not_get_its_tail_routed_out(tmp_path):
    """The middle trickles downstream and says it holds nothing to forward; the tail has nothing unread. The two
    ends disagree on where the bytes are and neither can be proven wrong, so the link's ends are separated: the
    tail is not dropped for "no progress", and every replica commits."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (relay,) = fleet.start([1])
        (middle,) = fleet.start([1], setup=_trickles_and_hides_it)
        (tail,) = fleet.start([1])
        sender = _sender(relay, middle, tail, timeout_s=3.0)
        try:
            report = sender.send_version(1, _one_per_bucket(_state(8, tensors=2)))
        finally:
            sender.close()
        everyone = sorted(str(r.endpoint) for r in (relay, middle, tail))
        assert sorted(report.committed) == everyone, report.failed
        assert all(_holds(replica, _state(8, tensors=2), 1) for replica in (relay, middle, tail))
