"""Attack scripts from the transport review, as test helpers: each plays one attacker against a real node."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import struct
import time

import torch

from areal_hex_plugin.transport import wire
from areal_hex_plugin.transport.buckets import pack
from areal_hex_plugin.transport.protocol import PROTOCOL_VERSION, Kind, digests_after, make
from areal_hex_plugin.transport.route import Endpoint
from tests.transport.harness import Proxy

_LENGTH = struct.Struct("!I")


class TokenHolder:
    """A peer that holds the shared token (e.g. any compromised rollout host) speaking the control protocol."""

    def __init__(
        self, endpoint: Endpoint, token: bytes, role: str = "control", source: str = "", **hello
    ) -> None:
        self.sock = socket.create_connection((endpoint.host, endpoint.port), 5.0, (source, 0))
        try:
            self.channel = wire.authenticate_as_client(self.sock, token)
        except BaseException:
            self.sock.close()
            raise
        self.send(
            {
                "kind": "hello",
                "role": role,
                "proto": PROTOCOL_VERSION,
                "session": hello.get("session", ""),
                "heartbeat_ms": hello.get("heartbeat_ms", 5000),
            }
        )

    def send(self, message: dict) -> None:
        """Any frame, tagged with this session's key (the attacker's side checks nothing)."""
        self.channel.send_frame(message)

    def ask(self, message: dict) -> dict:
        """Send and return the answer as a dict (``t``: its kind; the node's heartbeats are skipped);
        ``{"t": "closed"}`` when the node hung up."""
        try:
            self.send({"id": 1, **message})
            while (answer := self.channel.recv()).kind == Kind.HEARTBEAT:
                pass
            return {"t": answer.kind.value, **answer.fields}
        except (OSError, ConnectionError, RuntimeError) as error:
            return {"t": "closed", "error": str(error)}

    def closed_by_peer(self, within_s: float) -> bool:
        return closed_by_peer(self.sock, within_s)

    def close(self) -> None:
        self.sock.close()


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """True when the peer closes (or resets) ``sock`` within ``within_s``, whatever it sent before."""
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return True
        return False
    except TimeoutError:
        return False
    except OSError:
        return True


def connection_flood(endpoint: Endpoint, count: int) -> list[socket.socket]:
    """Idle TCP connections that never start the handshake (the file-descriptor exhaustion attack); connects
    do not wait, so a full accept queue does not slow the attacker down."""
    flood = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((endpoint.host, endpoint.port))
        flood.append(sock)
    time.sleep(0.5)
    for sock in flood:
        sock.setblocking(True)
    return flood


class TamperingProxy(Proxy):
    """On-path attacker without the token: rewrites 64 bytes of every bucket payload it forwards to ``target``
    (against the CRC-only protocol it also re-forced the header's CRC-32; no field it could recompute is left)."""

    def __init__(self, target: Endpoint, tamper_at: int = 1000) -> None:
        super().__init__(target)
        self.tamper_at, self.tampered = tamper_at, 0

    def _pump(self, source: socket.socket, sink: socket.socket, forward: bool) -> None:
        if not forward:
            return super()._pump(source, sink, forward)
        try:  # handshake bytes pass; then every frame is parsed and payloads after a bucket frame rewritten
            sink.sendall(wire.recv_exact(source, wire.CLIENT_HELLO_BYTES))  # client nonce, key share, proof
            while True:
                length = wire.recv_exact(source, _LENGTH.size)
                body = wire.recv_exact(source, _LENGTH.unpack(length)[0])
                tag = wire.recv_exact(source, wire.TAG_BYTES)
                header = json.loads(body)
                nbytes = header.get("nbytes", 0) if header.get("kind") == "bucket" else 0
                payload = bytearray(wire.recv_exact(source, nbytes))
                if len(payload) > self.tamper_at + 64:
                    payload[self.tamper_at : self.tamper_at + 64] = bytes(64)
                    self.tampered += 1
                sink.sendall(length + body + tag + bytes(payload))
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)


class SocketBytes:
    """Payload bytes on a data channel itself (the ``tcp`` link), for attackers that send buckets."""

    def __init__(self, channel) -> None:
        self.channel = channel

    def send(self, chunk: torch.Tensor) -> None:
        self.channel.send_bytes(memoryview(chunk.numpy()))


def send_bucket(
    channel,
    link,
    session: str,
    version: int,
    index: int,
    copy: int,
    named: dict[str, torch.Tensor],
    key: bytes,
    chunk: int,
    cut: bool = False,
) -> str:
    """A bucket of ``named`` with chunk digests made with ``key`` (what a relay that holds the token computes)
    on ``channel`` and ``link``; ``cut``: the header only, then the channel is closed. Returns its digest."""
    bucket = pack(index, named.items(), key, chunk)
    header = make(
        Kind.BUCKET,
        session=session,
        version=version,
        index=index,
        copy=copy,
        nbytes=bucket.nbytes,
        chunk=chunk,
        manifest=bucket.manifest(),
    )
    channel.send(header)
    if cut:
        channel.close()
        return ""
    for offset in range(0, bucket.nbytes, chunk):
        link.send(bucket.data[offset : offset + chunk])
    if hasattr(link, "flush"):
        link.flush()
    channel.send(digests_after(header, bucket.chunks))
    return bucket.digest(key)


def raw_connection(endpoint: Endpoint, source: str = "") -> socket.socket | None:
    """One TCP connection that never starts the handshake (None when the node's queue is full)."""
    sock = socket.socket()
    sock.setblocking(False)
    sock.bind((source, 0))
    if sock.connect_ex((endpoint.host, endpoint.port)) not in (0, errno.EINPROGRESS):
        sock.close()
        return None
    sock.setblocking(True)
    return sock


class RecordingProxy(Proxy):
    """On-path observer (it may hold the token): forwards everything and keeps every byte of connection ``i``
    in ``seen[(i, True)]`` (towards the target) and ``seen[(i, False)]`` (back)."""

    def __init__(self, target: Endpoint) -> None:
        self.seen: dict[tuple[int, bool], bytearray] = {}
        super().__init__(target)

    def _pump(self, source: socket.socket, sink: socket.socket, forward: bool) -> None:
        index = next(i for i, pair in enumerate(self.connections) if source in pair)
        seen = self.seen.setdefault((index, forward), bytearray())
        try:
            while data := source.recv(1 << 16):
                seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self.cut(index)
