"""Authenticated connections: the shared-token handshake, then every frame tagged with a per-session key.

Why HMAC frames and not mutual TLS: every machine already holds the shared token, and weights need integrity, not
secrecy. TLS would need a certificate authority and a key pair on every rollout machine, and would encrypt every
payload byte on the relay's hot path. Here the handshake (two fresh nonces and an ephemeral Diffie-Hellman exchange
in RFC 3526's 2048-bit group, each side proving the token over everything it saw) derives a session key
``HMAC(token, "hex-session" | server nonce | client nonce | shared secret)``, so another token holder that reads
every byte of the connection (a relay on the path) still cannot compute it; the server does its modular
exponentiations only after the client proved the token. Every frame after it carries
``HMAC-SHA256(session key, direction | sequence number | body)``, so a frame cannot be forged, changed, replayed,
reordered or moved to another connection without the token. Payload bytes travel outside frames (on the socket,
or through a gloo/NCCL group) and are authenticated by their keyed chunk digests, which the bucket's frame
carries (``buckets.py``): a receiver uses no byte before its digest matched.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.protocol import MAX_FRAME_BYTES, Kind, Message, ProtocolError, make, parse

TOKEN_ENV = "AREAL_HEX_TRANSPORT_TOKEN"
TAG_BYTES = 32
_NONCE_BYTES = 16
# RFC 3526 group 14 (2048-bit MODP), generator 2; exponents of 256 bits.
_DH_PRIME = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3B"
    "E39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6955817183995497CEA956AE515D2261898FA0510"
    "15728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
_SHARE_BYTES = 256
# What the client sends after the server's nonce: its nonce, its key share and its proof.
CLIENT_HELLO_BYTES = _NONCE_BYTES + _SHARE_BYTES + 32
_LENGTH = struct.Struct("!I")
_SEQUENCE = struct.Struct("!Q")
# Control frames a peer may send that its reader keeps no use for (heartbeats, late or duplicate answers and
# reports): this many at once, refilled at this rate; a peer over it is cut off.
IDLE_FRAMES_BURST = 256
IDLE_FRAMES_PER_S = 64.0


class TransportError(RuntimeError):
    """A weight update could not complete; replicas keep their last committed version."""


class AuthError(TransportError):
    """The peer does not hold the shared token."""


class CutOff(TransportError):
    """A peer cut off: over its cap of control frames, or silent past its bound."""


class FrameBudget:
    """A peer's allowance of control frames: ``burst`` at once, refilled at ``per_s`` a second."""

    def __init__(self, burst: int = IDLE_FRAMES_BURST, per_s: float = IDLE_FRAMES_PER_S) -> None:
        self.burst, self.per_s = burst, per_s
        self._left, self._at = float(burst), time.monotonic()

    def spend(self) -> None:
        """Take one frame from the allowance; raises :class:`CutOff` when none is left."""
        now = time.monotonic()
        self._left = min(self.burst, self._left + (now - self._at) * self.per_s) - 1
        self._at = now
        if self._left < 0:
            raise CutOff(f"over its cap of {self.burst} control frames at once and {self.per_s:g} a second")


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


def recv_exact(sock: socket.socket, nbytes: int, deadline: float | None = None) -> bytes:
    buffer = bytearray(nbytes)
    recv_exact_into(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def _recv_exact_by(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """``nbytes`` by ``deadline`` (time.monotonic), waiting in select: the socket's timeout, which other threads'
    sends use, stays as it is."""
    buffer = bytearray(nbytes)
    view, received = memoryview(buffer), 0
    while received < nbytes:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise TimeoutError("deadline passed")
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("peer closed the connection")
        received += count
    return bytes(buffer)


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; with a ``deadline`` (time.monotonic) the whole read must end by then, however it trickles."""
    received = 0
    while received < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("peer closed the connection")
        received += count


class Channel:
    """An authenticated connection: frames are ``length | JSON body | tag``; payload bytes go raw."""

    def __init__(self, sock: socket.socket, key: bytes, client: bool) -> None:
        self.sock, self._key = sock, key
        self._out, self._in = (b"c", b"s") if client else (b"s", b"c")
        self._sent = self._received = 0
        self._send_lock = threading.Lock()

    @property
    def key(self) -> bytes:
        """The connection's own key (from the handshake's nonces): only its two ends hold it."""
        return self._key

    @property
    def peer_host(self) -> str:
        return self.sock.getpeername()[0]

    def _tag(self, direction: bytes, sequence: int, body: bytes) -> bytes:
        return hmac.digest(self._key, direction + _SEQUENCE.pack(sequence) + body, "sha256")

    def send(self, message: Message) -> None:
        self.send_frame(message.to_wire())

    def send_frame(self, body: dict[str, Any]) -> None:
        """Any JSON object as a tagged frame (``send`` checks it against the schema first)."""
        data = json.dumps(body, separators=(",", ":")).encode()
        with self._send_lock:
            tag = self._tag(self._out, self._sent, data)
            self.sock.sendall(_LENGTH.pack(len(data)) + data + tag)
            self._sent += 1

    def recv(self, expect: set[Kind] | None = None, deadline: float | None = None) -> Message:
        return self._frame(lambda nbytes: recv_exact(self.sock, nbytes, deadline), expect)

    def recv_within(self, expect: set[Kind] | None, within_s: float) -> Message:
        """The next frame, whole within ``within_s`` (else TimeoutError); the socket's timeout stays as it is (a
        control channel's other threads send on it)."""
        deadline = time.monotonic() + within_s
        return self._frame(lambda nbytes: _recv_exact_by(self.sock, nbytes, deadline), expect)

    def _frame(self, read, expect: set[Kind] | None) -> Message:
        (length,) = _LENGTH.unpack(read(_LENGTH.size))
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {length} bytes refused (at most {MAX_FRAME_BYTES})")
        data = read(length + TAG_BYTES)
        body, tag = data[:length], data[length:]
        if not hmac.compare_digest(tag, self._tag(self._in, self._received, body)):
            raise ProtocolError("frame failed its authentication tag (changed, replayed or forged)")
        self._received += 1
        try:
            decoded = json.loads(body)
        except ValueError as error:
            raise ProtocolError(f"frame is not JSON ({error})") from None
        return parse(decoded, expect)

    def peer_closed(self) -> bool:
        """True when the peer has closed the connection (its end-of-stream or a reset is waiting) or it is gone;
        bytes waiting unread do not count."""
        try:  # select first: with a timeout set, Python waits that long for a byte whatever the flags say
            return (
                bool(select.select([self.sock], [], [], 0)[0]) and self.sock.recv(1, socket.MSG_PEEK) == b""
            )
        except (OSError, ValueError):  # reset, or closed here (no descriptor)
            return True

    def readable(self) -> bool:
        """True when bytes are waiting (a frame that already arrived)."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def send_bytes(self, view: memoryview) -> None:
        with self._send_lock:
            self.sock.sendall(view)

    def recv_into(self, view: memoryview) -> None:
        recv_exact_into(self.sock, view)

    def settimeout(self, timeout_s: float | None) -> None:
        self.sock.settimeout(timeout_s)

    def close(self) -> None:
        """Shut down first: a thread blocked reading this socket holds it open, so a bare close would send the
        peer nothing until that read returns."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Heartbeat:
    """Sends a heartbeat frame on a control channel every ``interval_s`` until stopped or a send fails."""

    def __init__(self, channel: Channel, interval_s: float) -> None:
        self.channel, self.interval_s = channel, interval_s
        self._stopped = threading.Event()
        threading.Thread(target=self._beat, name="hex-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.channel.send(make(Kind.HEARTBEAT))
            except OSError:  # the channel's reader hears of it too, and ends the channel
                return

    def stop(self) -> None:
        self._stopped.set()


def _key_pair() -> tuple[int, bytes]:
    exponent = secrets.randbits(256) | 1 << 255
    return exponent, pow(2, exponent, _DH_PRIME).to_bytes(_SHARE_BYTES, "big")


def _shared_secret(exponent: int, share: bytes) -> bytes | None:
    """The Diffie-Hellman secret with the peer's ``share``; None for a share outside (1, p - 1)."""
    value = int.from_bytes(share, "big")
    if not 1 < value < _DH_PRIME - 1:
        return None
    return pow(value, exponent, _DH_PRIME).to_bytes(_SHARE_BYTES, "big")


def _session_key(token: bytes, server_nonce: bytes, client_nonce: bytes, secret: bytes) -> bytes:
    return hmac.digest(token, b"hex-session" + server_nonce + client_nonce + secret, "sha256")


def _proof(token: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, side + first + second, hashlib.sha256).digest()


def authenticate_as_client(sock: socket.socket, token: bytes) -> Channel:
    """Prove the token to the server over both nonces and this side's key share, check the server's proof over
    its share too (mutual; no secret on the wire)."""
    exponent, share = _key_pair()
    try:
        server_nonce = recv_exact(sock, _NONCE_BYTES)
        hello = secrets.token_bytes(_NONCE_BYTES) + share
        sock.sendall(hello + _proof(token, b"client", server_nonce, hello))
        answer = recv_exact(sock, _SHARE_BYTES + 32)
    except (OSError, ConnectionError) as error:
        raise AuthError(
            f"peer closed the connection during the handshake: a wrong token, or this machine is not on the "
            f"receiver's allowed hosts ({error})"
        ) from error
    server_share, proof = answer[:_SHARE_BYTES], answer[_SHARE_BYTES:]
    if not hmac.compare_digest(proof, _proof(token, b"server", hello, server_nonce + server_share)):
        raise AuthError("peer does not hold the shared transport token")
    secret = _shared_secret(exponent, server_share)
    if secret is None:
        raise AuthError("peer sent an invalid key share")
    return Channel(sock, _session_key(token, server_nonce, hello[:_NONCE_BYTES], secret), client=True)


def authenticate_as_server(sock: socket.socket, token: bytes, deadline: float) -> Channel | None:
    """The channel when the client proved the token by ``deadline``; None (the caller closes) otherwise."""
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(server_nonce)
    hello = recv_exact(sock, CLIENT_HELLO_BYTES, deadline)
    hello, proof = hello[:-32], hello[-32:]
    if not hmac.compare_digest(proof, _proof(token, b"client", server_nonce, hello)):
        return None
    exponent, share = _key_pair()  # only now: an unproven client costs no exponentiation
    secret = _shared_secret(exponent, hello[_NONCE_BYTES:])
    if secret is None:
        return None
    sock.sendall(share + _proof(token, b"server", hello, server_nonce + share))
    return Channel(sock, _session_key(token, server_nonce, hello[:_NONCE_BYTES], secret), client=False)


def connect(host: str, port: int, token: bytes, timeout_s: float) -> Channel:
    """An authenticated channel with ``timeout_s`` on every blocking call."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as error:
        raise TransportError(f"cannot reach receiver {host}:{port}: {error}") from error
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    try:
        return authenticate_as_client(sock, token)
    except BaseException:
        sock.close()
        raise


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


def resolve_hosts(names: list[str]) -> set[str]:
    """Every address the names resolve to (``localhost`` -> 127.0.0.1 and ::1); an IP stands for itself."""
    addresses: set[str] = set()
    for name in names:
        try:
            addresses.update(info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP))
        except socket.gaierror as error:
            raise HexError(
                "hex.relay.allowed_hosts", f"{name!r} does not resolve ({error})", "list host names or IPs"
            ) from None
    return addresses
