"""Data links between two neighbours of a route: the payload bytes, after the control header.

``tcp`` sends the bytes on the authenticated TCP connection itself (works everywhere, the fallback where NCCL
cannot span the two sides); ``gloo`` and ``nccl`` open a two-rank torch.distributed group whose rendezvous
address is handed over that authenticated connection, so no unauthenticated peer learns it.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from typing import Protocol

import torch
import torch.distributed as dist

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.config import RELAY_BACKENDS as BACKENDS
from areal_hex_plugin.transport.wire import (
    TransportError,
    connect,
    recv_exact_into,
    recv_message,
    send_message,
)

_TAG = 7


class DataLink(Protocol):
    def send(self, chunk: torch.Tensor) -> None: ...

    def recv_into(self, chunk: torch.Tensor) -> None: ...

    def close(self) -> None: ...


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise HexError(
            "hex.relay.backend", f"unknown backend {backend!r}", f"use one of {', '.join(BACKENDS)}"
        )
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise HexError("hex.relay.backend", "nccl needs CUDA GPUs on both sides", "use gloo or tcp here")
    return backend


class SocketLink:
    """Payload on the TCP connection that carries the headers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, chunk: torch.Tensor) -> None:
        self.sock.sendall(memoryview(chunk.numpy()))

    def recv_into(self, chunk: torch.Tensor) -> None:
        recv_exact_into(self.sock, memoryview(chunk.numpy()))

    def close(self) -> None:
        """The socket belongs to the caller."""


class TorchLink:
    """Payload through a two-rank gloo or NCCL group (rank 0 sends, rank 1 receives)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, device: torch.device, store: dist.Store) -> None:
        self.group, self.rank, self.device = group, rank, device
        self._store: dist.Store | None = store  # keeps the rendezvous server alive as long as the group
        self._staging: torch.Tensor | None = None

    def _on_device(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging[:nbytes]

    def send(self, chunk: torch.Tensor) -> None:
        payload = chunk
        if self.device.type != "cpu":
            payload = self._on_device(chunk.numel())
            payload.copy_(chunk, non_blocking=False)
        self.group.send([payload], 1 - self.rank, _TAG).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the staging buffer is refilled by the next chunk

    def recv_into(self, chunk: torch.Tensor) -> None:
        target = chunk if self.device.type == "cpu" else self._on_device(chunk.numel())
        self.group.recv([target], 1 - self.rank, _TAG).wait()
        if target is not chunk:
            chunk.copy_(target)

    def close(self) -> None:
        """Shut the group down and free its store and staging buffer (a new link is opened per version)."""
        group, self.group = self.group, None
        # Not dist.destroy_process_group: the group was built directly, not registered with the default world.
        if group is not None:
            group.shutdown()
        self._store = self._staging = None


def _make_group(
    backend: str, store: dist.Store, rank: int, local_host: str, timeout_s: float
) -> tuple[dist.ProcessGroup, torch.device]:
    """A two-rank group bound to ``local_host``: the address this side of the authenticated connection uses."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        return dist.ProcessGroupGloo(store, rank, 2, options), torch.device("cpu")
    # NCCL picks its network interface itself (NCCL_SOCKET_IFNAME / NCCL_IB_HCA); the rendezvous is ours.
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    return dist.ProcessGroupNCCL(store, rank, 2, options), device


def open_sending_link(sock: socket.socket, backend: str, timeout_s: float) -> DataLink:
    """Upstream side; the peer runs :func:`open_receiving_link` on the same connection."""
    send_message(sock, {"t": "link", "backend": backend})
    if backend == "tcp":
        return SocketLink(sock)
    offer = recv_message(sock)
    if offer.get("t") != "link_offer":
        raise ConnectionError(f"receiver could not open a {backend} link: {offer.get('error', offer)}")
    store = dist.TCPStore(
        offer["host"], offer["port"], 2, False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    prefixed = dist.PrefixStore(offer["prefix"], store)
    group, device = _make_group(backend, prefixed, 0, sock.getsockname()[0], timeout_s)
    return TorchLink(group, 0, device, store)


def connect_data_link(
    host: str, port: int, token: bytes, session: str, backend: str, timeout_s: float
) -> tuple[socket.socket, DataLink]:
    """Connect to a node's data side for ``session`` and open the sending link; the socket is closed on failure."""
    sock = connect(host, port, token, timeout_s)
    try:
        send_message(sock, {"role": "data", "session": session})
        return sock, open_sending_link(sock, backend, timeout_s)
    except (OSError, RuntimeError, ValueError) as error:  # torch's store and group errors are RuntimeErrors
        sock.close()
        raise TransportError(f"cannot open a {backend} data link to {host}:{port}: {error}") from error


def open_receiving_link(sock: socket.socket, timeout_s: float) -> DataLink:
    request = recv_message(sock)
    backend = request.get("backend")
    if backend == "tcp":
        return SocketLink(sock)
    try:
        check_backend(backend)
    except HexError as error:
        send_message(sock, {"t": "link_error", "error": str(error)})
        raise ConnectionError(str(error)) from error
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(sock.getsockname()[0], 0, 2, True, timeout=timeout, wait_for_workers=False)
    prefix = secrets.token_hex(8)
    send_message(
        sock, {"t": "link_offer", "host": sock.getsockname()[0], "port": store.port, "prefix": prefix}
    )
    group, device = _make_group(backend, dist.PrefixStore(prefix, store), 1, sock.getsockname()[0], timeout_s)
    return TorchLink(group, 1, device, store)
