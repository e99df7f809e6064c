"""Real multi-process transfers: bit-exact into different TP layouts, bad buckets re-sent, failures handled."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import shard_dim
from areal_hex_plugin.transport.wire import TransportError
from tests.transport.harness import (
    TOKEN,
    Proxy,
    ReplicaFleet,
    in_buckets,
    relay_digest,
    small_qwen2_state_dict,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_state() -> dict[str, torch.Tensor]:
    return small_qwen2_state_dict()


def _assert_holds(replica, state: dict[str, torch.Tensor], version: int) -> None:
    committed = replica.committed()
    assert committed["version"] == version
    shards = committed["shards"]
    assert len(shards) == replica.tp_size
    for name, full in state.items():
        dim = shard_dim(name)
        pieces = [shards[rank][name] for rank in range(replica.tp_size)]
        if dim is None:
            assert all(torch.equal(piece, full) for piece in pieces), name
        else:
            assert all(piece.shape[dim] == full.shape[dim] // replica.tp_size for piece in pieces), name
            assert torch.equal(torch.cat(pieces, dim), full), name


@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_bit_exact_into_different_tp_layouts(tmp_path, model_state, backend):
    with ReplicaFleet(tmp_path) as fleet:
        pool_a = fleet.start([1, 2, 4])
        pool_b = fleet.start([2, 2])
        route = Route(
            [
                PoolRoute("h20", [r.endpoint for r in pool_a], 1.5, 5.0),
                PoolRoute("l40s", [r.endpoint for r in pool_b], 1.5, 5.0),
            ]
        )
        sender = RelaySender(route, SenderConfig(backend=backend, chunk_bytes=64 << 10), token=TOKEN)
        try:
            report = sender.send_version(1, in_buckets(model_state, per_bucket=5))
        finally:
            sender.close()
    assert report.failed == {} and report.resent_buckets == 0
    assert sorted(report.committed) == sorted(str(r.endpoint) for r in pool_a + pool_b)
    assert report.nbytes == sum(t.numel() * t.element_size() for t in model_state.values())
    for replica in pool_a + pool_b:
        _assert_holds(replica, model_state, 1)
    # Whoever holds the token can check a copy of the weights against the sender's digest.
    buckets = [(i, [n for n, _ in bucket]) for i, bucket in enumerate(in_buckets(model_state, per_bucket=5))]
    audit = dict(model_state)
    assert relay_digest(audit, buckets, 1, 1, report.update, TOKEN, 64 << 10) == report.digest
    name = next(iter(audit))
    audit[name] = audit[name].clone()
    audit[name].view(-1)[0] += 1
    assert relay_digest(audit, buckets, 1, 1, report.update, TOKEN, 64 << 10) != report.digest


def test_corrupted_bucket_is_resent(tmp_path, model_state):
    with ReplicaFleet(tmp_path) as fleet:
        relay, *rest = fleet.start([1, 2, 1])
        proxy = Proxy(relay.endpoint, corrupt_at=300_000)
        route = Route([PoolRoute("h20", [proxy.endpoint] + [r.endpoint for r in rest], 1.5, 5.0)])
        sender = RelaySender(route, SenderConfig(backend="tcp", chunk_bytes=64 << 10), token=TOKEN)
        try:
            report = sender.send_version(4, in_buckets(model_state, per_bucket=3))
        finally:
            sender.close()
            proxy.close()
    assert proxy.corrupted == 1
    assert report.resent_buckets == 1 and report.failed == {}
    for replica in (relay, *rest):
        _assert_holds(replica, model_state, 4)


def _kill_when_transferring(replica, proxy: Proxy) -> threading.Thread:
    """Kill ``replica`` once 256 KiB more have gone through ``proxy`` (a slow link, so mid-transfer)."""
    start, deadline = proxy.forwarded, time.monotonic() + 30

    def kill() -> None:
        while proxy.forwarded < start + (256 << 10) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(replica.process.pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("on_failure", ["fail", "reroute"])
def test_relay_killed_mid_transfer(tmp_path, model_state, on_failure):
    old = {name: torch.zeros_like(tensor) for name, tensor in model_state.items()}
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        relay, *rest = fleet.start([1, 1, 2])
        proxy = Proxy(relay.endpoint, bytes_per_s=1.5e6)
        route = Route([PoolRoute("h20", [proxy.endpoint] + [r.endpoint for r in rest], 1.5, 5.0)])
        config = SenderConfig(backend="tcp", chunk_bytes=64 << 10, timeout_s=5.0, on_failure=on_failure)
        sender = RelaySender(route, config, token=TOKEN)
        try:
            first = sender.send_version(1, in_buckets(old, per_bucket=40))
            assert len(first.committed) == 3
            killer = _kill_when_transferring(relay, proxy)
            began = time.monotonic()
            if on_failure == "fail":
                with pytest.raises(
                    TransportError, match=rf"{proxy.endpoint}.*no replica committed version 2"
                ):
                    sender.send_version(2, in_buckets(model_state, per_bucket=3))
            else:
                report = sender.send_version(2, in_buckets(model_state, per_bucket=3))
            elapsed = time.monotonic() - began
            killer.join()
        finally:
            sender.close()
            proxy.close()
    assert elapsed < 20, "failure must be detected within the configured timeout, not hang"
    if on_failure == "fail":
        for replica in rest:
            _assert_holds(replica, old, 1)
    else:
        assert list(report.failed) == [str(proxy.endpoint)] and report.reroutes >= 1
        assert sorted(report.committed) == sorted(str(r.endpoint) for r in rest)
        for replica in rest:
            _assert_holds(replica, model_state, 2)


def test_silent_link_is_detected_within_timeout_and_rerouted(tmp_path, model_state):
    with ReplicaFleet(tmp_path, timeout_s=2.0) as fleet:
        relay, *rest = fleet.start([1, 2, 1])
        proxy = Proxy(relay.endpoint, stall_after=400_000)
        route = Route([PoolRoute("h20", [proxy.endpoint] + [r.endpoint for r in rest], 1.5, 5.0)])
        sender = RelaySender(
            route, SenderConfig(backend="tcp", chunk_bytes=64 << 10, timeout_s=2.0), token=TOKEN
        )
        began = time.monotonic()
        try:
            report = sender.send_version(3, in_buckets(model_state, per_bucket=3))
        finally:
            sender.close()
            proxy.close()
        elapsed = time.monotonic() - began
    assert proxy.stalled.is_set()
    assert 2.0 <= elapsed < 10.0
    assert (
        list(report.failed) == [str(proxy.endpoint)]
        and "no progress within 2 s" in report.failed[str(proxy.endpoint)]
    )
    assert relay.committed()["version"] == -1
    for replica in rest:
        _assert_holds(replica, model_state, 3)


def test_middle_replica_killed_mid_transfer_is_routed_around(tmp_path, model_state):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        relay, middle, tail = fleet.start([1, 2, 1])
        proxy = Proxy(relay.endpoint, bytes_per_s=1.5e6)
        route = Route([PoolRoute("h20", [proxy.endpoint, middle.endpoint, tail.endpoint], 1.5, 5.0)])
        sender = RelaySender(
            route, SenderConfig(backend="tcp", chunk_bytes=64 << 10, timeout_s=5.0), token=TOKEN
        )
        killer = _kill_when_transferring(middle, proxy)
        began = time.monotonic()
        try:
            report = sender.send_version(9, in_buckets(model_state, per_bucket=3))
        finally:
            killer.join()
            sender.close()
            proxy.close()
        elapsed = time.monotonic() - began
    assert elapsed < 20
    assert list(report.failed) == [str(middle.endpoint)] and report.reroutes >= 1
    assert sorted(report.committed) == sorted([str(proxy.endpoint), str(tail.endpoint)])
    for replica in (relay, tail):
        _assert_holds(replica, model_state, 9)
    assert middle.committed()["version"] == -1
