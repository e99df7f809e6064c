"""A version in parts from several senders (as every FSDP rank or pipeline stage sends its own share): each
sender's bytes go over its own link, the replicas assemble the parts bit-exactly, a part corrupted on its link or
a replica lost mid-version is repaired by the parts' own senders, and a part that is missing or misreported is
never committed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from areal_hex_plugin.transport.buckets import bucket_index
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import PartSender, RelaySender, SenderConfig
from areal_hex_plugin.transport.wire import TransportError
from tests.transport.harness import TOKEN, Proxy, ReplicaFleet, small_qwen2_state_dict
from tests.transport.test_relay_transfer import _assert_holds

pytestmark = pytest.mark.integration

PARTS = 3


@pytest.fixture(scope="module")
def model_state() -> dict[str, torch.Tensor]:
    return small_qwen2_state_dict()


def _shares(state: dict[str, torch.Tensor]) -> list[list[list[tuple[str, torch.Tensor]]]]:
    """Each part's buckets: tensors dealt to the part with the fewest bytes so far, 4 tensors a bucket."""
    owned: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(PARTS)]
    sizes = [0] * PARTS
    for name, tensor in state.items():
        part = sizes.index(min(sizes))
        owned[part].append((name, tensor))
        sizes[part] += tensor.numel() * tensor.element_size()
    return [[items[i : i + 4] for i in range(0, len(items), 4)] for items in owned]


class _Senders:
    """The coordinator (part 0, through one proxy) and PartSenders 1.. (each through its own proxy to the
    relay), so the bytes each sender puts on the wire are counted apart."""

    def __init__(self, fleet_endpoints) -> None:
        relay, *rest = fleet_endpoints
        self.proxies = [Proxy(relay) for _ in range(PARTS)]
        route = Route([PoolRoute("h20", [self.proxies[0].endpoint, *rest], 1.5, 5.0)])
        config = SenderConfig(backend="tcp", chunk_bytes=64 << 10, timeout_s=10.0)
        self.coordinator = RelaySender(route, config, token=TOKEN, parts=PARTS)
        self.parts: list[PartSender] = []

    def begin(self, version: int, tokens: dict[int, bytes] | None = None) -> None:
        """``tokens``: a part whose sender holds another token than the replicas."""
        self.coordinator.begin(version)
        assignment = self.coordinator.assignment()
        for part in range(1, PARTS):
            pools = {"h20": {**assignment["pools"]["h20"], "relay": str(self.proxies[part].endpoint)}}
            token = (tokens or {}).get(part, TOKEN)
            self.parts.append(PartSender({**assignment, "pools": pools}, part, token=token))

    def send(self, shares) -> list:
        for bucket in shares[0]:
            self.coordinator.send_bucket(bucket)
        for sender, buckets in zip(self.parts, shares[1:], strict=True):
            for bucket in buckets:
                sender.send_bucket(bucket)
        return [sender.finish() for sender in self.parts]

    def complete(self, summaries) -> object:
        """Repair rounds (as the train side runs them) until nothing is missing, then verify and commit."""
        while (plan := self.coordinator.settle(summaries)) is not None:
            summaries = [sender.repair(plan) for sender in self.parts]
        return self.coordinator.finish(parts=summaries)

    def close(self) -> None:
        for sender in self.parts:
            sender.close()
        self.coordinator.close()
        for proxy in self.proxies:
            proxy.close()


def test_each_sender_carries_its_share_and_the_replicas_assemble_the_whole(tmp_path, model_state):
    model_bytes = sum(t.numel() * t.element_size() for t in model_state.values())
    with ReplicaFleet(tmp_path) as fleet:
        replicas = fleet.start([1, 2])
        senders = _Senders([r.endpoint for r in replicas])
        try:
            senders.begin(1)
            report = senders.complete(senders.send(_shares(model_state)))
        finally:
            senders.close()
        for replica in replicas:
            _assert_holds(replica, model_state, 1)
    assert report.committed == [str(senders.proxies[0].endpoint), str(replicas[1].endpoint)]
    assert report.nbytes == model_bytes and report.failed == {}
    wire = [proxy.forwarded for proxy in senders.proxies]
    # Each sender's link carries about a third of the model (plus frames), and no byte twice.
    assert all(0.25 * model_bytes < sent < 0.45 * model_bytes for sent in wire), (wire, model_bytes)
    assert model_bytes < sum(wire) < 1.1 * model_bytes


def _refused(tmp_path, model_state, tamper, tokens: dict[int, bytes] | None = None) -> tuple[str, list]:
    """Version 1 whole, then version 2 with ``tamper(summaries)`` applied (and the parts' ``tokens``): the error
    and the replicas' versions."""
    with ReplicaFleet(tmp_path) as fleet:
        replicas = fleet.start([1, 1])
        senders = _Senders([r.endpoint for r in replicas])
        try:
            senders.begin(1)
            senders.complete(senders.send(_shares(model_state)))
            for sender in senders.parts:
                sender.close()
            senders.parts = []
            second = {name: tensor + 1 for name, tensor in model_state.items()}
            senders.begin(2, tokens)
            summaries = tamper(senders.send(_shares(second)))
            with pytest.raises(TransportError) as failure:
                senders.complete(summaries)
        finally:
            senders.close()
        held = [replica.committed()["version"] for replica in replicas]
        for replica in replicas:
            _assert_holds(replica, model_state, 1)
    return str(failure.value), held


def test_a_part_whose_sender_reaches_no_replica_refuses_the_commit(tmp_path, model_state):
    error, held = _refused(
        tmp_path, model_state, lambda summaries: summaries, {2: b"another-token-0123456789"}
    )
    assert "data link from the sender of part 2" in error and "no replica left" in error and held == [1, 1]


def test_a_part_missing_from_the_summaries_refuses_the_commit(tmp_path, model_state):
    error, held = _refused(tmp_path, model_state, lambda summaries: summaries[:1])
    assert "parts [1] reported, expected 1 to 2" in error and held == [1, 1]


def test_a_part_corrupted_on_its_link_is_sent_again_by_its_sender(tmp_path, model_state):
    with ReplicaFleet(tmp_path) as fleet:
        replicas = fleet.start([1, 1])
        senders = _Senders([r.endpoint for r in replicas])
        senders.proxies[1].corrupt_at = 200_000  # once, in part 1's stream
        try:
            senders.begin(1)
            report = senders.complete(senders.send(_shares(model_state)))
        finally:
            senders.close()
        for replica in replicas:
            _assert_holds(replica, model_state, 1)
    assert senders.proxies[1].corrupted == 1 and report.resent_buckets == 1 and report.failed == {}


def test_a_replica_lost_mid_version_is_routed_around_and_every_part_sent_again(tmp_path, model_state):
    with ReplicaFleet(tmp_path) as fleet:
        replicas = fleet.start([1, 1, 1])
        senders = _Senders([r.endpoint for r in replicas])
        try:
            senders.begin(1)
            os.kill(replicas[1].process.pid, signal.SIGKILL)  # the chain through it is set up, then it dies
            report = senders.complete(senders.send(_shares(model_state)))
        finally:
            senders.close()
        for replica in (replicas[0], replicas[2]):
            _assert_holds(replica, model_state, 1)
    assert report.committed == [str(senders.proxies[0].endpoint), str(replicas[2].endpoint)]
    assert list(report.failed) == [str(replicas[1].endpoint)] and report.reroutes >= 1


def test_the_replicas_refuse_a_part_whose_digest_is_not_what_arrived(tmp_path, model_state):
    def other_digest(summaries):  # part 2's report names a bucket digest that none of its buckets has
        summaries[1].buckets[0][1] = "0" * 64
        return summaries

    error, held = _refused(tmp_path, model_state, other_digest)
    assert "part 2: digest differs from its sender's" in error and held == [1, 1]


def test_bucket_indices_name_their_part():
    assert [bucket_index(1, PARTS, i) % PARTS for i in range(4)] == [1] * 4
    assert len({bucket_index(p, PARTS, i) for p in range(PARTS) for i in range(5)}) == PARTS * 5


def test_each_part_has_one_data_link_that_carries_only_that_parts_buckets():
    from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
    from areal_hex_plugin.transport.sinks import MemorySink
    from tests.transport.attacks import TokenHolder

    receiver = ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0), token=TOKEN)
    endpoint, session = receiver.start(), "a" * 16
    control = TokenHolder(endpoint, TOKEN)
    prepare = {"session": session, "update": "0" * 64, "version": 1, "upstream": [""], "parts": 2}
    assert control.ask({"kind": "prepare", **prepare})["t"] == "ready"
    manifest = [["w", "uint8", [4096], 0, 4096]]
    header = {
        "session": session,
        "version": 1,
        "copy": 0,
        "nbytes": 4096,
        "chunk": 4096,
        "manifest": manifest,
    }
    links = []

    def link(*indices: int) -> TokenHolder:
        """A data link sending a whole bucket (bad digests: never staged) for each index but the last."""
        data = TokenHolder(endpoint, TOKEN, role="data", session=session)
        links.append(data)
        data.send({"kind": "link", "backend": "tcp"})
        for n, index in enumerate(indices):
            data.send({"kind": "bucket", "index": index, **header})
            if n < len(indices) - 1:
                data.sock.sendall(bytes(4096))
                data.send({"kind": "digests", "session": session, "version": 1, "index": index, "copy": 0,
                           "chunks": ["0" * 64]})  # fmt: skip
        return data

    try:
        first = link(0)  # holds part 0's lane while its payload is awaited
        deadline = time.monotonic() + 5
        while 0 not in receiver._session.lanes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link(2).closed_by_peer(within_s=2.0)  # part 0 again, on a second link
        assert link(1, 0).closed_by_peer(within_s=2.0)  # part 1's link sends a bucket of part 0
        assert not first.closed_by_peer(within_s=0.5)
    finally:
        for data in links:
            data.close()
        control.close()
        receiver.stop()
