"""Framed control messages over TCP and the shared-token handshake that guards every connection."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from typing import Any

from areal_hex_plugin.errors import HexError

TOKEN_ENV = "AREAL_HEX_TRANSPORT_TOKEN"
_NONCE_BYTES = 16
_LENGTH = struct.Struct("!I")
_MAX_HEADER_BYTES = 64 << 20


class TransportError(RuntimeError):
    """A weight update could not complete; replicas keep their last committed version."""


class AuthError(TransportError):
    """The peer does not hold the shared token."""


def load_token(env: dict[str, str] | None = None) -> bytes:
    """The shared token from the environment (the same value on the trainer and every rollout machine)."""
    value = (os.environ if env is None else env).get(TOKEN_ENV, "")
    if len(value) < 16:
        raise HexError(
            TOKEN_ENV,
            "missing or shorter than 16 characters",
            f"export the same secret on every machine, e.g. export {TOKEN_ENV}=$(openssl rand -hex 16)",
        )
    return value.encode()


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if length > _MAX_HEADER_BYTES:
        raise TransportError(f"control message of {length} bytes refused")
    return json.loads(recv_exact(sock, length))


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buffer = bytearray(nbytes)
    recv_exact_into(sock, memoryview(buffer))
    return bytes(buffer)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    received = 0
    while received < len(view):
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("peer closed the connection")
        received += count


def _proof(token: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, side + first + second, hashlib.sha256).digest()


def authenticate_as_client(sock: socket.socket, token: bytes) -> None:
    """Prove the token to the server and check the server's proof (mutual, nothing secret on the wire)."""
    try:
        server_nonce = recv_exact(sock, _NONCE_BYTES)
        client_nonce = secrets.token_bytes(_NONCE_BYTES)
        sock.sendall(client_nonce + _proof(token, b"client", server_nonce, client_nonce))
        answer = recv_exact(sock, 32)
    except (OSError, ConnectionError) as error:
        raise AuthError(f"peer refused the connection during the token handshake ({error})") from error
    if not hmac.compare_digest(answer, _proof(token, b"server", client_nonce, server_nonce)):
        raise AuthError("peer does not hold the shared transport token")


def authenticate_as_server(sock: socket.socket, token: bytes) -> bool:
    """True when the client proved the token; on False the caller closes the connection."""
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(server_nonce)
    reply = recv_exact(sock, _NONCE_BYTES + 32)
    client_nonce, proof = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(token, b"client", server_nonce, client_nonce)):
        return False
    sock.sendall(_proof(token, b"server", client_nonce, server_nonce))
    return True


def connect(host: str, port: int, token: bytes, timeout_s: float) -> socket.socket:
    """An authenticated TCP connection with ``timeout_s`` on every blocking call."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as error:
        raise TransportError(f"cannot reach receiver {host}:{port}: {error}") from error
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        authenticate_as_client(sock, token)
    except BaseException:
        sock.close()
        raise
    return sock


def interface_address(name: str) -> str:
    """The IPv4 address of this machine's network interface ``name`` (``hex.relay.bind_interface``)."""
    import psutil

    interfaces = psutil.net_if_addrs()
    host = socket.gethostname()
    if name not in interfaces:
        raise HexError(
            "hex.relay.bind_interface",
            f"rollout machine {host} has no network interface {name!r}",
            f"use one of {', '.join(sorted(interfaces))}, or null for the machine's own address",
        )
    for address in interfaces[name]:
        if address.family == socket.AF_INET:
            return address.address
    raise HexError(
        "hex.relay.bind_interface",
        f"interface {name!r} of rollout machine {host} has no IPv4 address",
        "bring it up with an address, or choose another interface",
    )
