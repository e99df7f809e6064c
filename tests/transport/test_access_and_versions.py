"""Access control (token, allowed peers) and version labels, with in-process receiver nodes on real sockets."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from areal_hex_plugin.transport.wire import (
    CLIENT_HELLO_BYTES,
    TOKEN_ENV,
    AuthError,
    TransportError,
    connect,
    load_token,
)
from tests.transport.harness import TOKEN


@pytest.fixture
def nodes():
    started: list[ReceiverNode] = []

    def start(count: int, **config) -> list[ReceiverNode]:
        for _ in range(count):
            node = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0, **config), token=TOKEN)
            node.endpoint = node.start()
            started.append(node)
        return started[-count:]

    yield start
    for node in started:
        node.stop()


def _route(*pools: list[ReceiverNode]) -> Route:
    return Route(
        [PoolRoute(f"pool{i}", [n.endpoint for n in pool], 1.5, 5.0) for i, pool in enumerate(pools)]
    )


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 32, generator=generator) for i in range(6)
    }


def test_wrong_token_is_refused_and_node_keeps_serving(nodes):
    (node,) = nodes(1)
    intruder = RelaySender(_route([node]), SenderConfig(timeout_s=5.0), token=b"not-the-shared-token-0000")
    with pytest.raises(TransportError, match="token"):
        intruder.begin(1)
    assert node.refused == 1 and node.version == -1
    with pytest.raises(AuthError):
        connect(node.endpoint.host, node.endpoint.port, b"another-wrong-token-000000", timeout_s=5.0)
    raw = socket.create_connection((node.endpoint.host, node.endpoint.port), timeout=5.0)
    raw.recv(16)
    raw.sendall(b"GET / HTTP/1.1\r\n\r\n".ljust(CLIENT_HELLO_BYTES, b"x"))  # a client hello's length
    assert raw.recv(64) == b""  # closed without an answer
    raw.close()
    assert node.refused == 3
    sender = RelaySender(_route([node]), SenderConfig(timeout_s=5.0), token=TOKEN)
    report = sender.send_version(1, [list(_state(0).items())])
    sender.close()
    assert report.committed == [str(node.endpoint)] and node.version == 1


def test_unknown_peer_address_is_refused(nodes):
    (node,) = nodes(1, allowed_hosts=["10.77.250.250"])
    sender = RelaySender(_route([node]), SenderConfig(timeout_s=5.0), token=TOKEN)
    with pytest.raises(TransportError, match="no replica left"):
        sender.begin(1)
    sender.close()
    assert node.refused == 1


def test_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(HexError, match=TOKEN_ENV):
        load_token()
    monkeypatch.setenv(TOKEN_ENV, "s" * 32)
    assert load_token() == b"s" * 32


def test_version_labels_follow_commits_and_survive_a_failed_update(nodes):
    pool_a, pool_b = nodes(2), nodes(1)
    sender = RelaySender(_route(pool_a, pool_b), SenderConfig(timeout_s=5.0), token=TOKEN)
    try:
        digests = {}
        for version in (1, 2, 5):
            state = _state(version)
            report = sender.send_version(version, [list(state.items())[:3], list(state.items())[3:]])
            digests[version] = report.digest
            status = sender.status()
            assert {answer["version"] for answer in status.values()} == {version}
            assert {answer["digest"] for answer in status.values()} == {report.digest}
            for node in pool_a + pool_b:
                assert node.sink.version == version
                assert all(torch.equal(node.sink.tensors[k], v) for k, v in state.items())
        assert len(set(digests.values())) == 3
        # Staged but never committed: an aborted version leaves every label and tensor where it was.
        sender.begin(6)
        sender.send_bucket(list(_state(6).items()))
        sender.finish(commit=False)
        sender.abort()
        assert {answer["version"] for answer in sender.status().values()} == {5}
        assert all(torch.equal(node.sink.tensors[k], v) for node in pool_a for k, v in _state(5).items())
    finally:
        sender.close()


class _RefusingSink(MemorySink):
    def load(self, version, named_tensors) -> None:
        raise RuntimeError("server refused the checkpoint")


def test_a_replica_whose_commit_fails_is_reported_and_keeps_its_version(nodes):
    good, bad = nodes(2)
    bad.sink = _RefusingSink()
    sender = RelaySender(_route([good, bad]), SenderConfig(timeout_s=5.0), token=TOKEN)
    try:
        report = sender.send_version(4, [list(_state(4).items())])
    finally:
        sender.close()
    assert report.committed == [str(good.endpoint)]
    assert "server refused the checkpoint" in report.failed[str(bad.endpoint)]
    assert good.version == 4 and bad.version == -1


def test_a_new_sender_takes_over_as_soon_as_the_old_one_closes(nodes):
    """One control channel per replica: the next sender (e.g. after hex_configure_transport) gets it at once."""
    (node,) = nodes(1)
    for version in (1, 2):
        sender = RelaySender(_route([node]), SenderConfig(timeout_s=5.0), token=TOKEN)
        try:
            assert sender.send_version(version, [list(_state(version).items())]).failed == {}
        finally:
            sender.close()
    assert node.version == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_a_stage_dir_too_small_for_the_version_fails_with_a_clear_error(tmp_path):
    small = tmp_path / "shm"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    node = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0, stage_dir=str(small)), token=TOKEN)
    endpoint = node.start()
    sender = RelaySender(
        Route([PoolRoute("h20", [endpoint], 1.5, 5.0)]), SenderConfig(timeout_s=5.0), token=TOKEN
    )
    try:
        with pytest.raises(TransportError, match=r"(?s)hex\.relay\.stage_dir.*MiB free.*--shm-size"):
            sender.send_version(1, [[("model.norm.weight", torch.ones(32 << 10))]])  # 128 KiB into 64 KiB
    finally:
        sender.close()
        node.stop()
        subprocess.run(["umount", str(small)], check=True)
    assert node.version == -1
