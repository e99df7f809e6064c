"""The transport review's attacks, each against real running nodes on real sockets (tests/transport/attacks.py
plays the attacker): none may stop a receiver, change weights, touch files, or commit what the trainer did not send.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time

import pytest
import torch

from areal_hex_plugin.transport.buckets import replica_key, seal
from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from areal_hex_plugin.transport.wire import TransportError
from tests.transport import attacks
from tests.transport.harness import TOKEN, ReplicaFleet, in_buckets, small_qwen2_state_dict, stop_process

pytestmark = pytest.mark.integration

_STATE = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32) for i in range(4)}


@pytest.fixture(scope="module")
def model_state() -> dict[str, torch.Tensor]:
    return small_qwen2_state_dict()


@pytest.fixture
def node():
    started: list[ReceiverNode] = []

    def start(**config) -> ReceiverNode:
        started.append(ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0, **config), token=TOKEN))
        started[-1].endpoint = started[-1].start()
        return started[-1]

    yield start
    for each in started:
        each.stop()


def _send(endpoints, version: int, state=None, **config) -> object:
    route = Route([PoolRoute("h20", list(endpoints), 1.5, 5.0)])
    sender = RelaySender(route, SenderConfig(timeout_s=5.0, **config), token=TOKEN)
    try:
        return sender.send_version(version, [list((state or _STATE).items())])
    finally:
        sender.close()


def _holds(replica, state, version) -> bool:
    committed = replica.committed()
    return committed["version"] == version and all(
        torch.equal(committed["shards"][0][name], tensor) for name, tensor in state.items()
    )


# -- the receiver keeps serving ----------------------------------------------------------------------------


@pytest.mark.slow
def test_descriptor_exhaustion_does_not_stop_the_accept_loop(tmp_path):
    with ReplicaFleet(tmp_path) as fleet:
        (replica,) = fleet.start([1], limits={resource.RLIMIT_NOFILE: 20})
        flood = attacks.connection_flood(replica.endpoint, 120)  # more than the replica may open
        time.sleep(1.0)
        for sock in flood:
            sock.close()
        report = _send([replica.endpoint], 1)
        assert report.committed == [str(replica.endpoint)] and _holds(replica, _STATE, 1)


@pytest.mark.slow
def test_idle_handshakes_are_capped_and_dropped_at_their_deadline(node):
    receiver = node()
    threads_before = threading.active_count()
    flood = attacks.connection_flood(receiver.endpoint, 100)
    time.sleep(0.5)
    assert threading.active_count() - threads_before <= 40  # a bounded number of handshakes at once
    try:
        began = time.monotonic()
        assert all(attacks.closed_by_peer(sock, within_s=8.0) for sock in flood[:5])
        assert time.monotonic() - began < 8.0
    finally:
        for sock in flood:
            sock.close()
    assert _send([receiver.endpoint], 1).committed == [str(receiver.endpoint)]


# -- nothing on the path changes weights -------------------------------------------------------------------


def test_payload_rewritten_on_the_path_is_never_committed(tmp_path, model_state):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        relay, tail = fleet.start([1, 1])
        proxy = attacks.TamperingProxy(relay.endpoint)
        route = Route([PoolRoute("h20", [proxy.endpoint, tail.endpoint], 1.5, 5.0)])
        config = SenderConfig(backend="tcp", chunk_bytes=64 << 10, timeout_s=5.0, max_resends=1)
        sender = RelaySender(route, config, token=TOKEN)
        try:
            report = sender.send_version(1, in_buckets(model_state, per_bucket=3))
        finally:
            sender.close()
            proxy.close()
        assert proxy.tampered >= 1
        assert relay.committed()["version"] == -1 and str(proxy.endpoint) in report.failed
        assert report.committed == [str(tail.endpoint)] and _holds(tail, model_state, 1)


# -- a token holder cannot take a node over ----------------------------------------------------------------


def test_bare_commit_without_a_verified_end_is_refused(node):
    receiver = node()
    attacker = attacks.TokenHolder(receiver.endpoint, TOKEN)
    commit = {"session": "a" * 16, "version": 999, "digest": "0" * 64, "seal": "0" * 64}
    answer = attacker.ask({"kind": "commit", **commit})
    attacker.close()
    assert answer["t"] in ("error", "closed") and receiver.version == -1 and receiver.sink.version == -1


def test_end_with_a_huge_bucket_count_is_refused_at_once(tmp_path):
    with ReplicaFleet(tmp_path) as fleet:
        (replica,) = fleet.start([1], limits={resource.RLIMIT_AS: 2 << 30})
        before = replica.peak_rss_mb()
        attacker = attacks.TokenHolder(replica.endpoint, TOKEN)
        attacker.ask(
            {
                "kind": "prepare",
                "session": "a" * 16,
                "update": "0" * 64,
                "version": 1,
                "upstream": [""],
                "parts": 1,
            }
        )
        began = time.monotonic()
        end = {"session": "a" * 16, "version": 1, "digest": "0" * 64, "parts": [[10**9, 0, "0" * 64]]}
        end["seal"] = seal(replica_key(attacker.channel.key, "a" * 16), "a" * 16, 1, "0" * 64)
        answer = attacker.ask({"kind": "end", **end})
        attacker.close()
        assert time.monotonic() - began < 2.0
        assert "buckets" in answer.get("error", "") and replica.peak_rss_mb() - before < 100


def test_huge_bucket_header_is_refused_before_any_allocation(node):
    receiver = node()
    control = attacks.TokenHolder(receiver.endpoint, TOKEN)
    control.ask(
        {
            "kind": "prepare",
            "session": "a" * 16,
            "update": "0" * 64,
            "version": 1,
            "upstream": [""],
            "parts": 1,
        }
    )
    data = attacks.TokenHolder(receiver.endpoint, TOKEN, role="data", session="a" * 16)
    data.send({"kind": "link", "backend": "tcp"})
    manifest = [["w", "uint8", [6 << 30], 0, 6 << 30]]
    bucket = {"session": "a" * 16, "version": 1, "index": 0, "copy": 0, "nbytes": 6 << 30, "chunk": 4 << 20}
    data.send({"kind": "bucket", **bucket, "manifest": manifest})
    try:
        assert data.closed_by_peer(within_s=2.0)
    finally:
        data.close()
        control.close()


@pytest.mark.parametrize("forged", ["digests", "position"])
def test_digests_after_the_bytes_must_match_them_and_their_bucket(node, forged):
    """The chunk digests follow a bucket's bytes: forged ones are a NACK, ones for another bucket end the link;
    either way nothing is staged."""
    receiver = node()
    control = attacks.TokenHolder(receiver.endpoint, TOKEN)
    prepare = {"session": "a" * 16, "update": "0" * 64, "version": 1, "upstream": [""], "parts": 1}
    control.ask({"kind": "prepare", **prepare})
    data = attacks.TokenHolder(receiver.endpoint, TOKEN, role="data", session="a" * 16)
    data.send({"kind": "link", "backend": "tcp"})
    bucket = {"session": "a" * 16, "version": 1, "index": 0, "copy": 0}
    data.send(
        {
            "kind": "bucket",
            **bucket,
            "nbytes": 8192,
            "chunk": 4096,
            "manifest": [["w", "uint8", [8192], 0, 8192]],
        }
    )
    data.channel.send_bytes(memoryview(bytes(8192)))
    position = {"index": 1} if forged == "position" else {}
    data.send({"kind": "digests", **bucket, **position, "chunks": ["0" * 64] * 2})
    try:
        if forged == "position":
            assert data.closed_by_peer(within_s=2.0)
        else:
            ack = control.channel.recv()
            assert (ack.kind.value, ack["index"], ack["ok"]) == ("ack", 0, False)
        assert receiver._session is None or receiver._session.stage.buckets == {}
    finally:
        data.close()
        control.close()


def _update_with_intruder(receiver: ReceiverNode, intrude) -> object:
    """An honest update of ``receiver`` with ``intrude(receiver)`` run between its begin and its bucket."""
    route = Route([PoolRoute("h20", [receiver.endpoint], 1.5, 5.0)])
    # Heartbeats every second: a second control channel waits out the open one's silence bound (3 of them) + 1 s.
    sender = RelaySender(route, SenderConfig(timeout_s=3.0, heartbeat_s=1.0), token=TOKEN)
    try:
        sender.begin(1)
        intrude(receiver)
        sender.send_bucket(list(_STATE.items()))
        return sender.finish()
    finally:
        sender.close()


def test_second_control_connection_cannot_take_the_replies(node):
    def second_control(receiver) -> None:
        attacker = attacks.TokenHolder(receiver.endpoint, TOKEN)
        answer = attacker.ask({"kind": "status"})
        assert answer["t"] == "error" and "another control channel is open" in answer["error"], answer
        attacker.close()

    receiver = node()
    report = _update_with_intruder(receiver, second_control)
    assert report.committed == [str(receiver.endpoint)] and receiver.version == 1


def test_data_connection_from_outside_the_route_is_refused(node):
    def outsider(receiver) -> None:
        with pytest.raises(TransportError):  # not a peer of the route: refused before the handshake
            attacks.TokenHolder(
                receiver.endpoint, TOKEN, role="data", session=receiver._session.id, source="127.0.0.2"
            ).ask({"kind": "link", "backend": "tcp"})

    receiver = node()
    assert _update_with_intruder(receiver, outsider).committed == [str(receiver.endpoint)]


def test_allow_list_resolves_host_names(node):
    receiver = node(allowed_hosts=["localhost"])
    assert _send([receiver.endpoint], 1).committed == [str(receiver.endpoint)]


def test_commit_path_from_the_peer_cannot_leave_the_stage_dir(tmp_path, monkeypatch):
    pytest.importorskip("areal")
    from areal.api.cli_args import InferenceEngineConfig

    from tests.transport.receiver_engine import ReceiverEngine
    from tests.transport.sglang_standin import SGLangStandIn

    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    victim = tmp_path / "victim" / "checkpoints"
    victim.mkdir(parents=True)
    (victim / "keep.bin").write_bytes(b"precious")
    server = SGLangStandIn(tp_size=1)
    engine = ReceiverEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="t", pause_grace_period=0.0)
    )
    engine.initialize(addr=server.address, train_data_parallel_size=1)
    try:
        from areal_hex_plugin.transport.route import Endpoint

        endpoint = Endpoint.parse(
            engine.hex_start_receiver(bind_host="127.0.0.1", stage_dir=str(tmp_path / "stage"))
        )
        attacker = attacks.TokenHolder(endpoint, TOKEN)
        answers = [
            attacker.ask(
                {
                    "kind": "commit",
                    "session": "a" * 16,
                    "version": version,
                    "digest": "0" * 64,
                    "seal": "0" * 64,
                }
            )
            for version in ("/x", "/../../../victim/checkpoints", "/../../../outside")
        ]
        attacker.close()
    finally:
        engine.hex_stop_receiver()
        engine.destroy()
        server.close()
    assert all(answer["t"] in ("error", "closed") for answer in answers)
    assert (victim / "keep.bin").read_bytes() == b"precious"
    assert {path.name for path in tmp_path.iterdir()} <= {"stage", "victim"}
    assert engine.get_version() == 0


# -- commit: one deadline, reconciled, never after being reported failed -----------------------------------


@pytest.mark.slow
def test_paused_replicas_cost_one_deadline_and_never_commit_later(tmp_path):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        replicas = fleet.start([1, 1, 1])
        route = Route([PoolRoute("h20", [r.endpoint for r in replicas], 1.5, 5.0)])
        sender = RelaySender(route, SenderConfig(timeout_s=2.0, commit_timeout_s=2.0), token=TOKEN)
        paused = replicas[1:]
        try:
            sender.begin(1)
            sender.send_bucket(list(_STATE.items()))
            sender.finish(commit=False)
            for replica in paused:
                stop_process(replica.process.pid)
            committing = threading.Thread(target=sender.commit, daemon=True)
            began = time.monotonic()
            committing.start()
            committing.join(timeout=15)
            elapsed = time.monotonic() - began
            for replica in paused:
                os.kill(replica.process.pid, signal.SIGCONT)
            assert not committing.is_alive() and elapsed < 8.0, f"commit took {elapsed:.1f} s"
            report = sender.last_report
            time.sleep(2.0)  # the paused replicas run again and read the queued commit
        finally:
            sender.close()
        assert report.committed == [str(replicas[0].endpoint)] and _holds(replicas[0], _STATE, 1)
        assert sorted(report.failed) == sorted(str(r.endpoint) for r in paused)
        assert all(replica.committed()["version"] == -1 for replica in paused)


# -- a failed load rolls back; a load that did not happen is caught ----------------------------------------


@pytest.fixture
def sglang_replica(tmp_path, monkeypatch):
    pytest.importorskip("areal")
    from areal.api.cli_args import InferenceEngineConfig

    from areal_hex_plugin.transport.route import Endpoint
    from tests.transport.receiver_engine import ReceiverEngine
    from tests.transport.sglang_standin import SGLangStandIn

    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    server = SGLangStandIn(tp_size=2)
    engine = ReceiverEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="t", pause_grace_period=0.0)
    )
    engine.initialize(addr=server.address, train_data_parallel_size=1)
    endpoint = Endpoint.parse(
        engine.hex_start_receiver(bind_host="127.0.0.1", stage_dir=str(tmp_path / "stage"))
    )
    yield server, engine, endpoint
    engine.hex_stop_receiver()
    engine.destroy()
    server.close()


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["load_fails_half_way", "load_silently_skipped"])
def test_failed_load_keeps_the_last_committed_version(sglang_replica, failure):
    server, engine, endpoint = sglang_replica
    first, second = small_qwen2_state_dict(seed=1), small_qwen2_state_dict(seed=2)
    for name in second:
        if name.endswith("norm.weight"):  # training moves the norms too
            second[name] = second[name] * 1.5
    route = Route([PoolRoute("h20", [endpoint], 1.5, 5.0)])
    sender = RelaySender(route, SenderConfig(timeout_s=5.0), token=TOKEN)
    try:
        assert sender.send_version(1, in_buckets(first, per_bucket=6)).committed == [str(endpoint)]
        server.fail_loads = failure == "load_fails_half_way"
        server.stale = failure == "load_silently_skipped"
        report = sender.send_version(2, in_buckets(second, per_bucket=6))
    finally:
        sender.close()
    assert report.committed == [] and str(endpoint) in report.failed
    assert engine.hex_receiver_status()["version"] == 1 and engine.get_version() == 1
    server.stale = server.fail_loads = False
    assert server.holds(first)
