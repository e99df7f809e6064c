"""A rollout replica's receiver: stage buckets, pass them down the chain, verify, commit atomically.

One node runs next to each inference replica. It listens on the configured interface and serves two kinds of
authenticated connections: the sender's *control* connection (prepare, end, commit, abort, status; the node
acknowledges every bucket on it) and a *data* connection from its upstream neighbour (the sender for the relay,
the previous replica otherwise). Each chunk is forwarded downstream as soon as it arrives, so the chain is
pipelined; a bucket counts as received only when its CRC matches, and the version reaches the sink only after
the sender's digest matched and the sender said commit. Until then the sink keeps serving the old version.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from areal_hex_plugin.transport.buckets import Bucket, checksum, entries_from_manifest, version_digest
from areal_hex_plugin.transport.links import DataLink, connect_data_link, open_receiving_link
from areal_hex_plugin.transport.route import Endpoint
from areal_hex_plugin.transport.wire import authenticate_as_server, load_token, recv_message, send_message

logger = logging.getLogger("HexTransportNode")


class WeightSink(Protocol):
    """Where a committed version goes (an inference server, or test receivers)."""

    def load(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None: ...


@dataclass
class ReceiverConfig:
    # The interface to bind (the address other replicas and the trainer reach this machine on).
    bind_host: str = "127.0.0.1"
    port: int = 0
    # A silent upstream, or a data link that stops moving, is given up after this long.
    timeout_s: float = 30.0
    # Peer addresses allowed to connect at all; empty: any peer that proves the token.
    allowed_hosts: list[str] = field(default_factory=list)


class _Forwarder:
    """Sends headers and chunks to the downstream neighbour on its own thread (the pipeline stage)."""

    def __init__(self, sock: socket.socket, link: DataLink, peer: str, report) -> None:
        self.sock, self.link, self.peer, self.report = sock, link, peer, report
        self.queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.broken = False
        self.thread = threading.Thread(target=self._run, name=f"hex-forward-{peer}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.broken:
                continue
            kind, payload = item
            try:
                if kind == "header":
                    send_message(self.sock, payload)
                else:
                    self.link.send(payload)
            except Exception as error:  # noqa: BLE001 - any failure of the downstream link is reported
                self.broken = True
                self.report({"t": "forward_failed", "peer": self.peer, "error": str(error)})

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)
        self.link.close()
        self.sock.close()


class ReceiverNode:
    """Serve weight updates for one replica; ``version`` is the last committed version (-1: none yet)."""

    def __init__(
        self, sink: WeightSink, config: ReceiverConfig | None = None, token: bytes | None = None
    ) -> None:
        self.sink = sink
        self.config = config or ReceiverConfig()
        self.token = token if token is not None else load_token()
        self.version = -1
        self.digest = ""
        self.refused = 0
        self._lock = threading.Lock()
        self._session = ""
        self._staged: dict[int, tuple[list[list[Any]], torch.Tensor, int]] = {}
        self._forwarder: _Forwarder | None = None
        self._control: socket.socket | None = None
        self._control_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> Endpoint:
        listener = socket.create_server((self.config.bind_host, self.config.port), backlog=16)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="hex-node-accept", daemon=True).start()
        return Endpoint(self.config.bind_host, listener.getsockname()[1])

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        self._drop_forwarder()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, address[0]), daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            allowed = self.config.allowed_hosts
            sock.settimeout(self.config.timeout_s)
            if (allowed and peer not in allowed) or not authenticate_as_server(sock, self.token):
                self.refused += 1
                logger.warning("refused a connection from %s (unknown peer or wrong token)", peer)
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = recv_message(sock)
            if hello.get("role") == "control":
                sock.settimeout(None)  # idle between versions; the sender closing ends it
                self._serve_control(sock)
            elif hello.get("role") == "data" and hello.get("session") == self._session:
                self._serve_data(sock)
        except (OSError, ConnectionError, ValueError, RuntimeError) as error:
            logger.info("connection from %s ended: %s", peer, error)
        finally:
            sock.close()

    # -- control ------------------------------------------------------------------------------------------

    def _report(self, message: dict[str, Any]) -> None:
        with self._control_lock:
            if self._control is not None:
                try:
                    send_message(self._control, message)
                except OSError:
                    logger.info("control connection lost while reporting %s", message.get("t"))

    def _serve_control(self, sock: socket.socket) -> None:
        with self._control_lock:
            self._control = sock
        while True:
            message = recv_message(sock)
            kind = message.get("t")
            handler = getattr(self, f"_on_{kind}", None)
            try:
                reply = handler(message) if handler else {"t": "error", "error": f"unknown message {kind}"}
            except Exception as error:  # noqa: BLE001 - e.g. the sink's server refused; the sender must hear it
                logger.exception("%s failed", kind)
                reply = {"t": "error", "error": f"{kind} failed on the replica: {error}"}
            self._report({**reply, "id": message.get("id")})  # the sender matches answers to requests

    def _drop_forwarder(self) -> None:
        if self._forwarder is not None:
            self._forwarder.close()
            self._forwarder = None

    def _on_prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        """Start a new session: drop whatever was staged and the old downstream link."""
        with self._lock:
            self._drop_forwarder()
            self._staged = {}
            self._session = message["session"]
        return {"t": "ready"}

    def _on_connect(self, message: dict[str, Any]) -> dict[str, Any]:
        """Open the data link to the downstream neighbour (already prepared for the same session)."""
        downstream = message["downstream"]
        try:
            endpoint = Endpoint.parse(downstream)
            sock, link = connect_data_link(
                endpoint.host,
                endpoint.port,
                self.token,
                message["session"],
                message["backend"],
                self.config.timeout_s,
            )
        except Exception as error:  # noqa: BLE001 - reported to the sender, which re-routes
            return {"t": "downstream_failed", "peer": downstream, "error": str(error)}
        self._forwarder = _Forwarder(sock, link, downstream, self._report)
        return {"t": "connected"}

    def _on_end(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            count = message["buckets"]
            missing = [index for index in range(count) if index not in self._staged]
            if missing:
                return {"t": "bad_digest", "error": f"buckets {missing[:5]} missing"}
            digest = version_digest(message["version"], [self._staged[i][0::2] for i in range(count)])
        if digest != message["digest"]:
            return {"t": "bad_digest", "error": "version digest differs from the sender's"}
        return {"t": "verified", "digest": digest}

    def _on_commit(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            staged, self._staged = self._staged, {}
            forwarder, self._forwarder = self._forwarder, None
        if forwarder is not None:  # tearing a link down can take a while; the answer need not wait for it
            threading.Thread(target=forwarder.close, daemon=True).start()
        buckets = [
            Bucket(i, entries_from_manifest(m), data, crc) for i, (m, data, crc) in sorted(staged.items())
        ]
        self.sink.load(message["version"], (item for bucket in buckets for item in bucket.named_tensors()))
        self.version, self.digest = message["version"], message["digest"]
        return {"t": "committed", "version": self.version}

    def _on_abort(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._staged = {}
            self._session = ""
            self._drop_forwarder()
        return {"t": "aborted"}

    def _on_status(self, message: dict[str, Any]) -> dict[str, Any]:
        return {"t": "status", "version": self.version, "digest": self.digest}

    # -- data ---------------------------------------------------------------------------------------------

    def _serve_data(self, sock: socket.socket) -> None:
        link = open_receiving_link(sock, self.config.timeout_s)
        try:
            while True:
                header = recv_message(sock)
                if header.get("s") != self._session:
                    return
                self._receive_bucket(header, link)
        finally:
            link.close()

    def _receive_bucket(self, header: dict[str, Any], link: DataLink) -> None:
        forwarder = self._forwarder
        if forwarder is not None:
            forwarder.queue.put(("header", header))
        data = torch.empty(header["n"], dtype=torch.uint8)
        step = header["chunk"]
        for offset in range(0, header["n"], step):
            chunk = data[offset : offset + step]
            link.recv_into(chunk)
            if forwarder is not None:
                forwarder.queue.put(("chunk", chunk))
        crc = checksum(data)
        ok = crc == header["crc"]
        if ok:
            with self._lock:
                if header["s"] == self._session:
                    self._staged[header["i"]] = (header["m"], data, crc)
        self._report({"t": "ack", "s": header["s"], "i": header["i"], "c": header["c"], "ok": ok})
