"""The second transport review's attacks and faults (issue 27), each against real nodes on real sockets, some in
real processes: an insider holding the token (a compromised relay, an idle node's stranger, a former upstream, a
flood of idle links) may not change what a replica commits nor keep the trainer out; a forked helper, a cut link, a
too-small stage, a gloo link at exit and a failed removal may not cost a version, a process or a file."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import resource
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.protocol import MAX_VERSION, Kind, make
from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from areal_hex_plugin.transport.wire import TransportError
from tests.transport import attacks
from tests.transport.harness import TOKEN, Proxy, ReplicaFleet, transport_records

pytestmark = pytest.mark.integration

_REPO = Path(__file__).resolve().parents[2]


def _state(seed: int, tensors: int = 4, rows: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(rows, 32, generator=generator)
        for i in range(tensors)
    }


def _holds(node: ReceiverNode, state: dict[str, torch.Tensor], version: int) -> bool:
    return (
        node.version == version
        and node.sink.tensors.keys() == state.keys()
        and all(torch.equal(node.sink.tensors[name], tensor) for name, tensor in state.items())
    )


@pytest.fixture
def node():
    started: list[ReceiverNode] = []

    def start(**config) -> ReceiverNode:
        config.setdefault("timeout_s", 5.0)
        started.append(ReceiverNode(MemorySink(), ReceiverConfig(**config), token=TOKEN))
        started[-1].endpoint = started[-1].start()
        return started[-1]

    yield start
    for each in started:
        each.stop()


def _sender(*endpoints: Endpoint, **config) -> RelaySender:
    config.setdefault("timeout_s", 5.0)
    return RelaySender(
        Route([PoolRoute("h20", list(endpoints), 1.5, 5.0)]), SenderConfig(**config), token=TOKEN
    )


def _run(script: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (its own exit, fork and signals), with the repository importable."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=_REPO,
        env={"PYTHONPATH": str(_REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


# -- 1. a relay cannot change what its downstream commits ---------------------------------------------------


def _post_end_refusals(monkeypatch) -> Callable[[float], bool]:
    """Waits (up to its argument, in seconds) for a node to refuse a bucket that came after its session's end."""
    records = transport_records("HexTransportNode", monkeypatch, logging.INFO)

    def refused(timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not any("after the end of session" in record.getMessage() for record in records):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    return refused


@pytest.mark.parametrize("attack", ["swap", "drop"])
def test_a_relay_cannot_change_what_its_tail_commits_after_the_end(node, monkeypatch, attack):
    """After the tail verified the version's end, the (compromised) relay re-sends a bucket on its own link with
    other bytes and chunk digests it computed with the content key, or starts one and cuts it: the tail refuses
    that bucket, then commits exactly the trainer's bytes."""
    refused = _post_end_refusals(monkeypatch)
    relay, tail = node(), node()
    state = _state(1)
    names = list(state)
    sender = _sender(relay.endpoint, tail.endpoint, chunk_bytes=4096)
    try:
        sender.begin(1)
        sender.send_bucket([(n, state[n]) for n in names[:2]])
        sender.send_bucket([(n, state[n]) for n in names[2:]])
        sender.finish(commit=False)
        session = relay._session
        forwarder = session.forwarders[0]  # the relay's own data link to the tail
        index = 0 if attack == "swap" else 1
        forged = {n: torch.zeros_like(state[n]) for n in names[index * 2 : index * 2 + 2]}
        with contextlib.suppress(OSError):  # the tail may hang up on it at once
            attacks.send_bucket(
                forwarder.channel,
                forwarder.link,
                session.id,
                1,
                index,
                1,
                forged,
                session.key,
                4096,
                cut=attack == "drop",
            )
        assert refused(10), "the tail took a bucket after the end"
        sender.commit()
        report = sender.last_report
    finally:
        sender.close()
    assert set(report.committed) == {str(relay.endpoint), str(tail.endpoint)}, report
    assert _holds(relay, state, 1) and _holds(tail, state, 1)
    assert tail.sink.version == 1 and tail.digest == relay.digest != ""


def test_the_commit_seal_is_the_control_channels_not_the_content_keys(node):
    """The version's seal is keyed by the control channel to that replica: an end whose seal is made with the
    content key (what the token and the update's nonce give every relay) is refused with the right version
    digest; the seal of the channel's own key is taken."""
    from areal_hex_plugin.transport.buckets import content_key, part_digest, replica_key, seal, version_digest

    receiver = node()
    control = attacks.TokenHolder(receiver.endpoint, TOKEN)
    session, update = "a" * 16, "1" * 64
    prepare = {"session": session, "update": update, "version": 1, "upstream": [""], "parts": 1}
    assert control.ask({"kind": "prepare", **prepare})["t"] == "ready"
    data = attacks.TokenHolder(receiver.endpoint, TOKEN, role="data", session=session)
    data.send({"kind": "link", "backend": "tcp"})
    key = content_key(TOKEN, update)
    state = _state(2, 1)
    bucket = attacks.send_bucket(
        data.channel, attacks.SocketBytes(data.channel), session, 1, 0, 0, state, key, 4096
    )
    assert control.channel.recv().kind == Kind.ACK
    part = part_digest(key, 0, [bucket])
    digest = version_digest(key, 1, [part])
    end = {
        "kind": "end",
        "session": session,
        "version": 1,
        "parts": [[1, 64 * 32 * 4, part]],
        "digest": digest,
    }
    forged = control.ask({**end, "seal": seal(key, session, 1, digest)})
    honest = control.ask({**end, "seal": seal(replica_key(control.channel.key, session), session, 1, digest)})
    data.close()
    control.close()
    assert forged["t"] == "error" and "seal" in forged["error"], forged
    assert honest["t"] == "verified", honest


def test_a_token_holder_on_the_path_cannot_derive_a_connections_key(node):
    """The seal's key comes from the control connection's key: one who holds the token and saw every byte of
    that connection (a relay on the path) must not be able to compute it from the handshake's nonces."""
    receiver = node()
    proxy = attacks.RecordingProxy(receiver.endpoint)
    sender = _sender(proxy.endpoint)
    try:
        assert sender.send_version(1, [list(_state(7).items())]).committed == [str(proxy.endpoint)]
        control_key = next(iter(sender._pools.values())).controls[proxy.endpoint].channel.key
    finally:
        sender.close()
        proxy.close()
    server_nonce, client_nonce = bytes(proxy.seen[(0, False)][:16]), bytes(proxy.seen[(0, True)][:16])
    assert control_key != hmac.digest(TOKEN, b"hex-session" + server_nonce + client_nonce, "sha256")


# -- 2. versions and routes come from the trainer alone -----------------------------------------------------


def test_an_idle_node_takes_no_version_from_a_stranger(node):
    """No route yet: a token holder on another host than the named trainer gets no control channel, so no
    version (here the largest there is, which would refuse every later one)."""
    receiver = node(trainer_hosts=["127.0.0.1"])
    try:
        stranger = attacks.TokenHolder(receiver.endpoint, TOKEN, source="127.0.0.2")
    except TransportError:
        answer = {"t": "refused"}
    else:
        prepare = {"session": "b" * 16, "update": "0" * 64, "upstream": [""], "parts": 1}
        answer = stranger.ask({"kind": "prepare", "version": MAX_VERSION, **prepare})
        stranger.close()
    assert answer["t"] in ("refused", "closed"), answer
    sender = _sender(receiver.endpoint)
    try:
        assert sender.send_version(1, [list(_state(1).items())]).committed == [str(receiver.endpoint)]
    finally:
        sender.close()
    assert _holds(receiver, _state(1), 1)


def test_a_version_far_above_the_committed_one_is_refused(node):
    receiver = node()
    sender = _sender(receiver.endpoint)
    try:
        sender.send_version(1, [list(_state(1).items())])
        with pytest.raises(TransportError, match="above the committed"):
            sender.send_version(MAX_VERSION, [list(_state(9).items())])
        report = sender.send_version(2, [list(_state(2).items())])
    finally:
        sender.close()
    assert report.committed == [str(receiver.endpoint)] and _holds(receiver, _state(2), 2)


# -- 3. a session's peers are exactly its route's -----------------------------------------------------------


def test_allowed_hosts_never_widen_a_session_beyond_its_route(node):
    """127.0.0.2 is on the allow-list (it was an upstream once) but not upstream in this session: its bucket,
    with digests made with the session's own key, is refused before it is staged or acknowledged."""
    receiver = node(allowed_hosts=["127.0.0.1", "127.0.0.2"])
    state = _state(3)
    sender = _sender(receiver.endpoint)
    try:
        sender.begin(1)
        session = receiver._session
        forged = {n: torch.zeros_like(t) for n, t in state.items()}
        try:
            former = attacks.TokenHolder(
                receiver.endpoint, TOKEN, role="data", session=session.id, source="127.0.0.2"
            )
        except TransportError:
            pass  # refused before the handshake
        else:
            former.send({"kind": "link", "backend": "tcp"})
            bytes_out = attacks.SocketBytes(former.channel)
            with contextlib.suppress(OSError):
                attacks.send_bucket(former.channel, bytes_out, session.id, 1, 0, 0, forged, session.key, 4096)
            assert former.closed_by_peer(within_s=3.0)
            former.close()
        assert 0 not in session.stage.buckets
        sender.send_bucket(list(state.items()))
        report = sender.finish()
    finally:
        sender.close()
    assert report.committed == [str(receiver.endpoint)] and _holds(receiver, state, 1)


# -- 4. limits per peer and in total; the trainer always gets through --------------------------------------


@pytest.mark.slow
def test_idle_authenticated_data_links_cannot_exhaust_the_node(tmp_path):
    """117 idle data links of the session from its upstream's host: the node keeps a few, refuses the rest at
    once, and the trainer's version still stages (its files need descriptors) and commits."""
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1], limits={resource.RLIMIT_NOFILE: 64})
        sender = _sender(replica.endpoint)
        held = []
        try:
            sender.begin(1)
            session = next(iter(sender._pools.values())).session
            for _ in range(117):
                try:
                    link = attacks.TokenHolder(replica.endpoint, TOKEN, role="data", session=session)
                    link.send({"kind": "link", "backend": "tcp"})
                    held.append(link)
                except (OSError, TransportError):
                    pass
            time.sleep(0.5)
            open_links = sum(not link.closed_by_peer(within_s=0.01) for link in held)
            sender.send_bucket(list(_state(4).items()))
            report = sender.finish()
        finally:
            for link in held:
                link.close()
            sender.close()
        assert open_links <= 8, f"{open_links} idle links kept"
        assert report.committed == [str(replica.endpoint)]
        committed = replica.committed()
        assert committed["version"] == 1
        assert all(torch.equal(committed["shards"][0][n], t) for n, t in _state(4).items())


@pytest.mark.slow
def test_an_unauthenticated_flood_does_not_keep_the_trainer_out(node):
    """A host that is no peer holds 36 idle connections, re-opened as the node drops them: the trainer still
    connects every time (4 versions by 4 senders, each with its own control channel)."""
    receiver = node(trainer_hosts=["127.0.0.1"], handshake_timeout_s=3.0)
    stop = threading.Event()

    def flood() -> None:
        held = []
        while not stop.is_set():
            held = [s for s in held if not attacks.closed_by_peer(s, 0.0)]
            for _ in range(36 - len(held)):
                sock = attacks.raw_connection(receiver.endpoint, source="127.0.0.2")
                if sock is not None:
                    held.append(sock)
            time.sleep(0.05)
        for sock in held:
            sock.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    time.sleep(0.5)
    committed = 0
    try:
        for version in range(1, 5):
            sender = _sender(receiver.endpoint)
            try:
                committed += sender.send_version(version, [list(_state(version).items())]).committed == [
                    str(receiver.endpoint)
                ]
            except TransportError:
                pass
            finally:
                sender.close()
    finally:
        stop.set()
        flooder.join(timeout=10)
    assert committed == 4 and _holds(receiver, _state(4), 4)


# -- 5. cleanup only in the owning process ------------------------------------------------------------------


def test_a_forked_child_that_exits_normally_leaves_the_receivers_dirs(tmp_path):
    result = _run(
        f"""
        import os, sys, torch
        from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
        from areal_hex_plugin.transport.route import PoolRoute, Route
        from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
        from areal_hex_plugin.transport.sinks import MemorySink
        token = {TOKEN!r}
        config = ReceiverConfig(timeout_s=5.0, stage_dir={str(tmp_path / "stage")!r},
                                rollback_dir={str(tmp_path / "rollback")!r})
        node = ReceiverNode(MemorySink(), config, token=token)
        endpoint = node.start()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a helper that ends the normal way: exit handlers run
        os.waitpid(pid, 0)
        assert node.stage_root.is_dir() and node.rollback_root.is_dir(), "the child removed them"
        sender = RelaySender(Route([PoolRoute("p", [endpoint], 1.5, 5.0)]), SenderConfig(timeout_s=5.0), token=token)
        report = sender.send_version(1, [[("w", torch.ones(64))]])
        sender.close()
        node.stop()
        assert report.committed == [str(endpoint)], report.failed
        assert not node.stage_root.exists() and not node.rollback_root.exists()
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# -- 6. a cut downstream link does not lose the version for the tail ----------------------------------------


def test_a_tail_whose_upstream_link_is_cut_is_repaired(node):
    relay, tail = node(), node()
    proxy = Proxy(tail.endpoint, bytes_per_s=4e6)
    sender = _sender(relay.endpoint, proxy.endpoint, chunk_bytes=16 << 10)
    first, second = _state(1, tensors=8, rows=2048), _state(2, tensors=8, rows=2048)  # 2 MiB
    try:
        assert len(sender.send_version(1, [list(first.items())]).committed) == 2
        data_links = len(proxy.connections)
        cutter = threading.Timer(0.2, lambda: proxy.cut(data_links - 1))  # the kept relay -> tail link
        cutter.start()
        report = sender.send_version(2, [list(second.items())[:4], list(second.items())[4:]])
        cutter.join()
    finally:
        sender.close()
        proxy.close()
    assert sorted(report.committed) == sorted([str(relay.endpoint), str(proxy.endpoint)]), report.failed
    assert report.reroutes >= 1  # the cut landed mid-version: a repair round, not a fresh link
    assert _holds(relay, second, 2) and _holds(tail, second, 2)


# -- 8. memory, space, exit, removal, IPv6 ------------------------------------------------------------------


def test_bucket_headers_alone_commit_no_memory(tmp_path):
    """Eight bucket headers at the size limit, no byte of payload: the replica's memory stays where it was."""
    with ReplicaFleet(tmp_path, timeout_s=3.0) as fleet:
        (replica,) = fleet.start([1])
        control = attacks.TokenHolder(replica.endpoint, TOKEN)
        prepare = {"session": "c" * 16, "update": "0" * 64, "version": 1, "upstream": [""], "parts": 8}
        assert control.ask({"kind": "prepare", **prepare})["t"] == "ready"
        before = replica.peak_rss_mb()
        links = []
        for part in range(8):
            link = attacks.TokenHolder(replica.endpoint, TOKEN, role="data", session="c" * 16)
            link.send({"kind": "link", "backend": "tcp"})
            nbytes = 2 << 30
            link.send(
                {
                    "kind": "bucket",
                    "session": "c" * 16,
                    "version": 1,
                    "index": part,
                    "copy": 0,
                    "nbytes": nbytes,
                    "chunk": 64 << 10,
                    "manifest": [["w", "uint8", [nbytes], 0, nbytes]],
                }
            )
            links.append(link)
        time.sleep(1.0)
        during = replica.peak_rss_mb()
        for link in links:
            link.close()
        control.close()
    assert during - before < 64, f"{during - before:.0f} MiB for headers alone"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_the_staged_receive_path_on_a_filled_stage_refuses_instead_of_sigbus(tmp_path):
    """The path NCCL uses (device buffer -> host -> ``piece.copy_``, a memcpy into the mapped stage file), here
    through a real two-rank gloo group on the CPU: the bucket passed the free-space check, then another replica
    filled the shared tmpfs. Its space must be reserved before each chunk lands: a clear error, not SIGBUS."""
    small = tmp_path / "shm"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], check=True)
    try:
        result = _run(
            f"""
            import datetime, os, threading, torch, torch.distributed as dist
            from pathlib import Path
            from areal_hex_plugin.errors import HexError
            from areal_hex_plugin.transport.buckets import TensorEntry
            from areal_hex_plugin.transport.links import TorchLink
            from areal_hex_plugin.transport.stage import StagedVersion
            root, n, step = Path({str(small)!r}), 2 << 20, 256 << 10
            stage = StagedVersion(root, 1)
            stage.allocate(0, 0, [TensorEntry("w", "uint8", (n,), 0, n)], n)
            with open(root / "other-replica", "wb", buffering=0) as other:  # the other replica fills what is left
                try:
                    while True:
                        other.write(bytes(64 << 10))
                except OSError:
                    pass
            store, groups = dist.HashStore(), [None, None]
            def group(rank):
                options = dist.ProcessGroupGloo._Options()
                options._timeout = datetime.timedelta(seconds=10)
                options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                groups[rank] = dist.ProcessGroupGloo(store, rank, 2, options)
            made = [threading.Thread(target=group, args=(rank,)) for rank in (0, 1)]
            [t.start() for t in made]
            [t.join() for t in made]
            sender = TorchLink(groups[0], 0, torch.device("cpu"), staged=True)
            receiver = TorchLink(groups[1], 1, torch.device("cpu"), staged=True)
            data = torch.ones(n, dtype=torch.uint8)
            def send():
                for offset in range(0, n, step):
                    sender.send(data[offset : offset + step])
                sender.flush()
            threading.Thread(target=send, daemon=True).start()
            try:
                for _ in receiver.receive(stage.landing(0, step)):
                    pass
                print("received", flush=True)
            except HexError as error:
                print("refused", "hex.relay.stage_dir" in str(error), flush=True)
            os._exit(0)
            """
        )
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)
    assert result.returncode == 0, f"exit {result.returncode} (-7: SIGBUS): {result.stderr[-2000:]}"
    assert result.stdout.split() == ["refused", "True"], result.stdout


def test_a_node_stopped_after_gloo_links_exits_cleanly():
    result = _run(
        f"""
        import torch
        from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
        from areal_hex_plugin.transport.route import PoolRoute, Route
        from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
        from areal_hex_plugin.transport.sinks import MemorySink
        token = {TOKEN!r}
        nodes = [ReceiverNode(MemorySink(), ReceiverConfig(timeout_s=5.0), token=token) for _ in range(2)]
        route = Route([PoolRoute("p", [n.start() for n in nodes], 1.5, 5.0)])
        sender = RelaySender(route, SenderConfig(backend="gloo", timeout_s=5.0), token=token)
        assert len(sender.send_version(1, [[("w", torch.ones(1000))]]).committed) == 2
        sender.close()
        for node in nodes:
            node.stop()
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        result.returncode,
        result.stderr[-3000:],
    )


def test_a_failed_version_removal_is_reported_and_retried(tmp_path, monkeypatch):
    from areal_hex_plugin.transport.stage import StagedVersion

    records = transport_records("HexStage", monkeypatch, logging.ERROR)
    staged = StagedVersion(tmp_path, 3)
    (staged.directory / "bucket-00000-00.safetensors").write_bytes(b"x" * 64)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    try:
        with pytest.raises(OSError):
            while True:
                held.append(open("/dev/null"))  # noqa: SIM115 - the descriptor table fills up
        staged.remove()
        failed_now = staged.directory.exists()
    finally:
        for handle in held:
            handle.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert failed_now and any(str(staged.directory) in record.getMessage() for record in records)
    staged.remove()
    assert not staged.directory.exists()


def test_the_node_listens_on_ipv6(node):
    receiver = node(bind_host="::1")
    assert receiver.endpoint.host == "::1"
    sender = _sender(receiver.endpoint)
    try:
        report = sender.send_version(1, [list(_state(6).items())])
    finally:
        sender.close()
    assert report.committed == [str(receiver.endpoint)] and _holds(receiver, _state(6), 1)


def test_control_frames_name_no_reserved_tensor():
    with pytest.raises(Exception, match="reserved"):
        make(
            Kind.BUCKET,
            session="a" * 16,
            version=1,
            index=0,
            copy=0,
            nbytes=4,
            chunk=4096,
            manifest=[["__metadata__", "float32", [1], 0, 4]],
        )
