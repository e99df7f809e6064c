"""Bounded control input (issue 37): a peer that floods well-formed control frames is cut off within a bound,
with one log line, and what it sent is dropped, not kept: at the trainer (a compromised replica floods its idle
control channel with ACK and STATE frames) and at a node (a trainer-host peer floods requests behind a commit).
The trainer here is the test process (a real RelaySender); the compromised replica a real ReceiverNode in a
process of its own, flooding over its real control channel."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time

import pytest

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.protocol import Kind, make
from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from tests.transport import attacks
from tests.transport.harness import TOKEN, ReplicaFleet, _status_kb, transport_records
from tests.transport.trainers import state_of

pytestmark = pytest.mark.integration

_CTX = mp.get_context("fork")
FLOOD_S = 8.0
# Within this the flooded end must have hung up (the flood runs at thousands of frames a second).
CUT_WITHIN_S = 4.0
KEPT_BOUND = 64
RSS_BOUND_MB = 24.0
# A STATE reply's data path fields: nothing loading, nothing queued.
_IDLE_PATH = {"loading": -1, "unread": 0, "backlog": 0, "unsent": 0}


def _records(logger_name: str, monkeypatch) -> list[logging.LogRecord]:
    return transport_records(logger_name, monkeypatch, logging.WARNING)


def _rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def _flooding_replica_main(stage: str, ready, flood, result) -> None:
    """A compromised replica: a real node that, once told, floods its control channel (to the trainer) with
    well-formed ACKs for the last session it was in and STATE replies to requests never made (each made, so
    checked, against the protocol's schema), for FLOOD_S or until the trainer hangs up; puts (frames sent, seconds
    until the send failed or None)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    node = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0, stage_dir=stage), token=TOKEN)
    sessions: list[str] = []
    prepare = node._on_prepare

    def noting_prepare(message):
        sessions.append(message["session"])
        return prepare(message)

    node._on_prepare = noting_prepare
    ready.put(node.start().port)
    flood.wait()
    channel, began, sent = node._control, time.monotonic(), 0
    try:
        while time.monotonic() - began < FLOOD_S:
            if sent % 2:
                channel.send(make(Kind.STATE, id=sent, version=1, digest="", **_IDLE_PATH))
            else:
                index, copy = (sent // 2) % 65536, (sent // 2) // 65536 % 4
                ack = {"session": sessions[-1], "index": index, "copy": copy, "ok": True, "error": ""}
                channel.send(make(Kind.ACK, **ack, received=0, digest=""))
            sent += 1
    except OSError:
        result.put((sent, time.monotonic() - began))
        return
    result.put((sent, None))


def test_a_replica_flooding_the_idle_trainer_is_cut_off_and_nothing_it_sent_is_kept(tmp_path, monkeypatch):
    records = _records("HexTransportSender", monkeypatch)
    ready, flood, result = _CTX.Queue(), _CTX.Event(), _CTX.Queue()
    liar = _CTX.Process(target=_flooding_replica_main, args=(str(tmp_path / "stage"), ready, flood, result))
    liar.start()
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (honest,) = fleet.start([1])
        compromised = Endpoint("127.0.0.1", ready.get(timeout=60))
        route = Route([PoolRoute("h20", [honest.endpoint, compromised], 1.5, 5.0)])
        sender = RelaySender(route, SenderConfig(timeout_s=10.0), token=TOKEN)
        try:
            assert len(sender.send_version(1, [list(state_of(1).items())]).committed) == 2
            control = sender._pools["h20"].controls[compromised]
            before = _rss_mb()
            flood.set()
            sent, cut_after = result.get(timeout=FLOOD_S + 30)
            grown = _rss_mb() - before
            kept = sender._events.qsize() + control.replies.qsize()
            assert len(sender.send_version(2, [list(state_of(2).items())]).committed) >= 1
        finally:
            sender.close()
            liar.kill()
            liar.join()
    assert cut_after is not None and cut_after <= CUT_WITHIN_S, f"{sent} frames sent, cut after {cut_after}"
    assert kept <= KEPT_BOUND, f"{kept} of {sent} frames kept"
    assert grown <= RSS_BOUND_MB, f"+{grown:.0f} MiB on the trainer for {sent} frames"
    cut = [r for r in records if str(compromised) in r.getMessage() and "cap" in r.getMessage()]
    assert len(cut) == 1, [r.getMessage() for r in records]
    assert honest.committed()["version"] == 2


@pytest.mark.parametrize("behind_a_commit", [True, False])
def test_a_control_peer_flooding_requests_is_cut_off(monkeypatch, behind_a_commit):
    """A peer on a trainer host (holding the token) sends requests as fast as it can (after a commit, which reads
    ahead what follows it, or not) while it reads every answer: the node hangs up within the bound, with one log
    line, its memory flat."""
    records = _records("HexTransportNode", monkeypatch)
    node = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0), token=TOKEN)
    endpoint = node.start()
    peer = attacks.TokenHolder(endpoint, TOKEN)
    answers = {"count": 0}

    def read_answers() -> None:
        try:
            while True:
                peer.channel.recv()
                answers["count"] += 1
        except (OSError, ConnectionError, RuntimeError):
            return

    reader = threading.Thread(target=read_answers, daemon=True)
    reader.start()
    commit = {"kind": "commit", "session": "a" * 16, "version": 1, "digest": "0" * 64, "seal": "0" * 64}
    before, began, sent, cut_after = _rss_mb(), time.monotonic(), 0, None
    try:
        if behind_a_commit:
            peer.send({"id": 1, **commit})
        while time.monotonic() - began < FLOOD_S:
            peer.send({"kind": "status", "id": 2 + sent})
            sent += 1
    except OSError:
        cut_after = time.monotonic() - began
    finally:
        grown = _rss_mb() - before
        peer.close()
        reader.join(5)
        node.stop()
    assert cut_after is not None and cut_after <= CUT_WITHIN_S, f"{sent} sent, {answers['count']} answered"
    assert grown <= RSS_BOUND_MB, f"+{grown:.0f} MiB on the node for {sent} requests"
    cut = [r for r in records if "cap" in r.getMessage()]
    assert len(cut) == 1, [r.getMessage() for r in records]
