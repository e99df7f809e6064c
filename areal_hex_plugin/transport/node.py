"""A rollout replica's receiver: stage buckets, pass them down the chain, verify, commit atomically.

One node runs next to each inference replica. It serves two kinds of authenticated channels: the sender's one
*control* channel (prepare, connect, end, commit, abort, status; the node acknowledges every bucket on it) and a
*data* channel per part of the version from its upstream neighbour (at the relay: from each sender). A version may come in parts from several senders (every training rank or pipeline stage sends its
own share); each part travels down the chain in its own lane (one data link per part and hop), so parts never
interleave on a link. Each chunk is forwarded downstream as soon as
it arrives (the chain is pipelined) and hashed on the hashing pool meanwhile; a bucket counts as received only when
every keyed chunk digest matches, and the version reaches the sink only on a ``commit`` of the same session whose
``end`` this node verified: every part complete, each part's digest and the version's matching, no tensor in two
buckets. Until the sink confirms the load, the last committed version stays.

Data links are kept from version to version while the sender's control channel stays: a committed session hands
its links to the downstream neighbour on to the next one, which reuses them when it names the same neighbour and
backend and every link is idle and open (otherwise they are closed and new ones opened); an incoming data link
serves every session whose upstream its peer is, each frame still authenticated with the connection's own key and
each chunk with the version's content key. A link that breaks, or carries a bucket of another session than the
node's, is closed, never reused.

Who may connect: the control channel only from the ``trainer_hosts`` its controller named (by default this
machine alone), so a node without a route accepts nobody else; data links only from the peers the trainer's
``prepare`` named for the current session, exactly those, whatever ``allowed_hosts`` (a further filter) says.
Versions come from that control channel alone, each above the committed one by at most ``max_version_step``.
Handshakes are capped in number (some slots kept for the trainer's hosts) and bounded by a deadline; data links are
capped per peer and in total, and a peer's link beyond one per part that carries no bucket by its deadline is
closed; the accept loop outlives descriptor exhaustion.

End to end: the trainer seals the version digest for each replica with a key of its control channel to that
replica (``buckets.replica_key``), which a relay never sees. A replica checks the seal at ``end``, takes no bucket
of the session after it, and right before it commits recomputes the digest from exactly what it holds staged and
checks the commit's seal again: a relay forwards the bytes but cannot vouch for them.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hmac
import logging
import queue
import socket
import struct
import tempfile
import termios
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.buckets import (
    bucket_digest,
    bucket_index,
    content_key,
    entries_from_manifest,
    hash_chunk,
    part_digest,
    replica_key,
    seal,
)
from areal_hex_plugin.transport.buckets import version_digest as digest_of_version
from areal_hex_plugin.transport.links import DataLink, connect_data_link, current_device, open_receiving_link
from areal_hex_plugin.transport.protocol import (
    MAX_PARTS,
    MIN_HEARTBEAT_MS,
    SILENT_HEARTBEATS,
    Kind,
    Message,
    ProtocolError,
    chunk_count,
    digests_after,
    make,
)
from areal_hex_plugin.transport.route import Endpoint
from areal_hex_plugin.transport.scratch import OwnedDir
from areal_hex_plugin.transport.stage import SparePages, StagedVersion
from areal_hex_plugin.transport.wire import (
    Channel,
    CutOff,
    FrameBudget,
    Heartbeat,
    authenticate_as_server,
    load_token,
    resolve_hosts,
)

logger = logging.getLogger("HexTransportNode")

_REQUESTS = {Kind.PREPARE, Kind.CONNECT, Kind.END, Kind.COMMIT, Kind.ABORT, Kind.STATUS}
# Requests read ahead behind a commit (what the sender may send after it: an abort, a status), or behind a
# request that waits for a load; how often a request waiting for a load looks at its channel.
_READ_AHEAD = 8
_HEARING_S = 0.05
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class WeightSink(Protocol):
    """Where a committed version goes (an inference server, or test receivers). ``staged`` iterates the
    version's (name, tensor) pairs; ``staged.directory`` holds it as safetensors files. The tensors' memory may stage
    a later version once ``load`` has returned (at once with a rollback dir): copy what must outlive the call.
    A sink may name its server in a ``server`` attribute: what to check when a commit's outcome is unknown."""

    def load(self, version: int, staged: Iterator[tuple[str, torch.Tensor]]) -> None: ...


@dataclass
class ReceiverConfig:
    # The interface to bind (the address other replicas and the trainer reach this machine on).
    bind_host: str = "127.0.0.1"
    port: int = 0
    # A silent upstream, or a data link that stops moving, is given up after this long.
    timeout_s: float = 30.0
    # Host names or addresses allowed to connect at all, on top of the route's own peers (never beyond them).
    allowed_hosts: list[str] = field(default_factory=list)
    # Node-local directory under which the node stages versions, in a dir of its own inside this user's private
    # areal-hex-uid<uid> (scratch.py); None: /dev/shm (else the temp dir).
    stage_dir: str | None = None
    # Node-local disk directory under which the last committed version moves once loaded (what a failed load rolls
    # back to), so a commit holds only the new version in memory; None: it stays in the stage dir.
    rollback_dir: str | None = None
    max_handshakes: int = 32
    # Handshake slots kept for connections from the trainer's hosts, on top of max_handshakes.
    trainer_handshakes: int = 4
    handshake_timeout_s: float = 5.0
    # Incoming data links at once, in total (each peer also at most two per part of the session, and two).
    max_data_links: int = 4 * MAX_PARTS
    # Where the trainer's control channel may come from (the controller names the sending train worker's host);
    # the default, this machine alone.
    trainer_hosts: list[str] = field(default_factory=lambda: ["127.0.0.1", "::1"])
    # A version more than this above the committed one is refused (the first version is taken as it comes).
    max_version_step: int = 1 << 16


@dataclass
class _Session:
    id: str
    version: int
    key: bytes
    upstream: set[str]
    parts: int
    stage: StagedVersion
    digests: dict[int, str] = field(default_factory=dict)
    # One forwarder per part (lane) to the downstream neighbour; empty at the tail.
    forwarders: list[_Forwarder] = field(default_factory=list)
    # The downstream neighbour and backend of the forwarders.
    downstream: tuple[str, str] = ("", "")
    # The data connection that carries each lane here (a second one for a lane is refused).
    lanes: dict[int, Channel] = field(default_factory=dict)
    # The key only the trainer and this replica hold for the session (the seal's).
    seal_key: bytes = b""
    # The buckets being received now; none may start once ``end`` sealed the session.
    receiving: set[int] = field(default_factory=set)
    sealed: bool = False
    # What ``end`` verified: the parts it announced and the version digest.
    announced: list[Any] = field(default_factory=list)
    verified: str = ""

    def take_forwarders(self) -> list[_Forwarder]:
        forwarders, self.forwarders = self.forwarders, []
        return forwarders


_CLOSING: set[threading.Thread] = set()  # forwarders being closed, waited for at exit (see _close_all)
_CLOSING_LOCK = threading.Lock()


def _close_all(forwarders: list[_Forwarder]) -> None:
    """Close forwarders on threads of their own (tearing a link down can take a while; nobody waits for it), but
    before the process exits: a gloo group still being shut down at exit aborts the process."""
    for forwarder in forwarders:
        thread = threading.Thread(target=_closing, args=(forwarder,), daemon=True)
        with _CLOSING_LOCK:  # started under the lock: wait_for_closing never sees a thread it cannot join yet
            _CLOSING.add(thread)
            thread.start()


def _closing(forwarder: _Forwarder) -> None:
    try:
        forwarder.close()
    finally:
        with _CLOSING_LOCK:
            _CLOSING.discard(threading.current_thread())


def wait_for_closing(timeout_s: float = 10.0) -> None:
    """Wait (at most ``timeout_s``) until every forwarder handed to :func:`_close_all` is closed."""
    deadline = time.monotonic() + timeout_s
    with _CLOSING_LOCK:
        threads = list(_CLOSING)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(wait_for_closing)


class _Forwarder:
    """Sends frames and chunks to the downstream neighbour on its own thread (the pipeline stage)."""

    def __init__(self, channel: Channel, link: DataLink, peer: str, session: str, report) -> None:
        self.channel, self.link, self.peer, self.report = channel, link, peer, report
        self.session = session  # the one it forwards for now (a kept forwarder moves on to the next)
        self.queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.broken = False
        self.backlog = 0  # chunk bytes queued here, not yet handed to the link
        self._counting = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"hex-forward-{peer}", daemon=True)
        self.thread.start()

    def put(self, kind: str, payload: Any) -> None:
        """Queue a frame or a chunk to forward."""
        self._count(kind, payload, 1)
        self.queue.put((kind, payload))

    def _count(self, kind: str, payload: Any, sign: int) -> None:
        if kind == "chunk":
            with self._counting:
                self.backlog += sign * payload.numel() * payload.element_size()

    def unsent(self) -> int:
        """Bytes handed to the link's socket that the downstream has not taken yet (the kernel's send queue)."""
        return _kernel_queue(self.channel.sock, termios.TIOCOUTQ)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                if not self.broken:
                    self._forward(*item)
            finally:
                self._count(*item, -1)
                self.queue.task_done()

    def _forward(self, kind: str, payload: Any) -> None:
        try:
            if kind == "frame":
                self.channel.send(payload)
            else:
                self.link.send(payload)
        except Exception as error:  # noqa: BLE001 - any failure of the downstream link is reported
            self.broken = True
            self.report(
                make(Kind.FORWARD_FAILED, session=self.session, peer=self.peer, error=str(error)[:2000])
            )

    def reusable(self) -> bool:
        """Idle (everything queued went out), never broken, and the neighbour has not closed the link."""
        return not self.broken and self.queue.unfinished_tasks == 0 and not self.channel.peer_closed()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)
        self.link.close()
        self.channel.close()


def _kernel_queue(sock: socket.socket, request: int) -> int:
    """Bytes in a socket's kernel queue (``termios.FIONREAD``: arrived, unread; ``TIOCOUTQ``: not yet taken by
    the peer); 0 for a closed socket."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, bytes(4)))[0]
    except (OSError, ValueError):
        return 0


class ReceiverNode:
    """Serve weight updates for one replica; ``version`` is the last committed version (-1: none yet)."""

    def __init__(
        self, sink: WeightSink, config: ReceiverConfig | None = None, token: bytes | None = None
    ) -> None:
        self.sink = sink
        self.config = config or ReceiverConfig()
        self.token = token if token is not None else load_token()
        self.device = current_device()  # read here: threads have their own current device
        self.version = -1
        self.digest = ""
        self.refused = 0
        self._allowed = resolve_hosts(self.config.allowed_hosts) if self.config.allowed_hosts else None
        self._trainers = resolve_hosts(self.config.trainer_hosts)
        self._lock = threading.Lock()
        self._session: _Session | None = None
        # The last committed session's forwarders, for the next session to reuse (see the module doc).
        self._kept: tuple[tuple[str, str], list[_Forwarder]] | None = None
        # Open incoming data channels with the threads serving them (they outlive sessions; stop() closes them).
        self._data: dict[Channel, threading.Thread] = {}
        # Staged versions whose removal failed, removed again at the next session and at stop().
        self._leftovers: list[StagedVersion] = []
        self._last_committed: StagedVersion | None = None
        self._control: Channel | None = None
        # The commit being loaded on its own thread, so status and abort are answered meanwhile, and its version.
        self._committing: threading.Thread | None = None
        self._loading = -1
        self._control_silence_s = 0.0  # how long the open control channel may be silent before it is closed
        self._handshakes = threading.BoundedSemaphore(self.config.max_handshakes)
        self._trainer_handshakes = threading.BoundedSemaphore(self.config.trainer_handshakes)
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        # Stage and rollback dirs of the node's own, gone with it (or with its process: see scratch.py).
        shm = Path("/dev/shm")
        stage_parent = self.config.stage_dir or (shm if shm.is_dir() else tempfile.gettempdir())
        self._scratch = [OwnedDir(Path(stage_parent), "hex.relay.stage_dir")]
        self.stage_root = self._scratch[0].path
        self._spare = SparePages(self.stage_root)
        self.rollback_root: Path | None = None
        if self.config.rollback_dir is not None:
            self._scratch.append(OwnedDir(Path(self.config.rollback_dir), "hex.relay.rollback_dir"))
            self.rollback_root = self._scratch[-1].path
        # Frees the version before the last committed one and spills the last committed one to disk.
        self._keeper: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> Endpoint:
        family = socket.getaddrinfo(self.config.bind_host, self.config.port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((self.config.bind_host, self.config.port), family=family, backlog=64)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="hex-node-accept", daemon=True).start()
        return Endpoint(self.config.bind_host, listener.getsockname()[1])

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            # Shut down first: a bare close leaves the port bound until the accept loop's accept returns.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        control, self._control = self._control, None
        if control is not None:
            control.close()
        self._await_commit()  # its session's stage and the keeper it starts are removed and joined below
        with self._lock:
            self._end_session()
            self._drop_kept()
            data, self._data = self._data, {}
        wait_for_closing()  # a gloo group still being shut down when the process exits aborts it
        for channel in data:
            channel.close()
        for thread in data.values():  # each closes its link (its group) as it ends
            thread.join(timeout=5)
        self._settle()
        self._remove_leftovers()
        for scratch in self._scratch:
            scratch.remove()

    def _accept_loop(self) -> None:
        """Accept until stopped; running out of descriptors or memory backs off and keeps serving."""
        assert self._listener is not None
        backoff = 0.05
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError as error:
                if self._stopping.is_set():
                    return
                if error.errno in _OUT_OF_DESCRIPTORS:
                    logger.error("cannot accept (%s); backing off %.2f s, still serving", error, backoff)
                    time.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                elif error.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN):
                    logger.error("accept failed (%s); still serving", error)
                    time.sleep(backoff)
                continue
            backoff = 0.05
            peer = address[0]
            if not self._peer_allowed(peer):  # before any handshake: no slot, no thread, no byte sent
                self._refuse(sock, peer, "not the trainer nor a peer of the route (hex.relay.trainer_hosts)")
                continue
            slot = self._handshake_slot(peer)
            if slot is None:
                self._refuse(sock, peer, "too many handshakes at once")
                continue
            try:
                threading.Thread(target=self._serve, args=(sock, peer, slot), daemon=True).start()
            except RuntimeError:  # no thread to be had: refuse, keep the loop
                slot.release()
                self._refuse(sock, peer, "no thread for the handshake")

    def _handshake_slot(self, peer: str) -> threading.BoundedSemaphore | None:
        """A free handshake slot: the trainer's hosts have slots of their own, then share the others."""
        pools = [self._trainer_handshakes, self._handshakes] if peer in self._trainers else [self._handshakes]
        return next((pool for pool in pools if pool.acquire(blocking=False)), None)

    def _refuse(self, sock: socket.socket, peer: str, reason: str) -> None:
        self.refused += 1
        logger.warning("refused a connection from %s: %s", peer, reason)
        sock.close()

    def _peer_allowed(self, peer: str, role: str = "") -> bool:
        """May ``peer`` connect (in ``role``; '' before the handshake: in either)? The control channel only from
        the trainer's hosts, data links only from the current session's upstream; ``allowed_hosts`` only
        narrows that."""
        if self._allowed is not None and peer not in self._allowed:
            return False
        session = self._session
        trainer = peer in self._trainers and role != "data"
        return trainer or (role != "control" and session is not None and peer in session.upstream)

    def _serve(self, sock: socket.socket, peer: str, slot: threading.BoundedSemaphore) -> None:
        channel: Channel | None = None
        try:
            try:
                deadline = time.monotonic() + self.config.handshake_timeout_s
                channel = authenticate_as_server(sock, self.token, deadline)
                if channel is None:
                    self._refuse(sock, peer, "wrong token")
                    return
                hello = channel.recv({Kind.HELLO}, deadline)
            finally:
                slot.release()
            if not self._peer_allowed(peer, hello["role"]):
                self._refuse(sock, peer, f"no {hello['role']} channel from a host that is not the route's")
                return
            if hello["role"] == "control" and hello["heartbeat_ms"] < MIN_HEARTBEAT_MS:
                self._refuse(sock, peer, f"a control channel beats at least every {MIN_HEARTBEAT_MS} ms")
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # both kinds idle between versions
            if hello["role"] == "control":
                self._serve_control(channel, hello["heartbeat_ms"] / 1000)
            else:
                self._serve_data(channel, hello["session"])
        except (OSError, ConnectionError, ValueError, RuntimeError) as error:
            logger.info("connection from %s ended: %s", peer, error)
        finally:
            sock.close()

    # -- control ------------------------------------------------------------------------------------------

    def _report(self, message: Message) -> None:
        control = self._control
        if control is not None:
            _send_on(control, message)

    def _take_control(self, channel: Channel, silence_s: float) -> bool:
        """One control channel at a time: a new one waits until the open one is closed, by its sender or for its
        silence (then within that channel's bound)."""
        deadline = time.monotonic() + self._control_silence_s + 1.0
        while True:
            with self._lock:
                if self._control is None or self._control.peer_closed():
                    self._control, self._control_silence_s = channel, silence_s
                    self._drop_kept()  # links are kept for one sender's control channel only
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _serve_control(self, channel: Channel, heartbeat_s: float) -> None:
        silence_s = SILENT_HEARTBEATS * heartbeat_s
        channel.settimeout(silence_s)  # a report the sender takes nothing of for that long ends the channel
        # Beating from the start: waiting for the open channel's bound may take longer than this channel's.
        heartbeat, budget = Heartbeat(channel, heartbeat_s), FrameBudget()
        if not self._take_control(channel, silence_s):
            heartbeat.stop()
            channel.send(make(Kind.ERROR, id=0, error="another control channel is open on this replica"))
            return
        pending: deque[Message] = deque()
        try:
            while True:
                message = pending.popleft() if pending else self._next_frame(channel, silence_s, budget)
                if message is None:
                    continue
                if message.kind not in (Kind.STATUS, Kind.ABORT):
                    self._await_commit_hearing(channel, silence_s, budget, pending)
                if message.kind == Kind.COMMIT:
                    while channel.readable():  # what the sender sent after it (an abort) already arrived
                        if len(pending) == _READ_AHEAD:
                            raise CutOff(f"over its cap of {_READ_AHEAD} requests behind a commit")
                        if (after := self._next_frame(channel, silence_s, budget)) is not None:
                            pending.append(after)
                    if any(m.kind == Kind.ABORT for m in pending):
                        reply = make(
                            Kind.ERROR, id=0, error="commit withdrawn by the sender (deadline passed)"
                        )
                        _answer(channel, reply, message)
                        continue
                    self._start_commit(message, channel)
                elif message.kind == Kind.ABORT and self._loading >= 0:
                    reply = make(
                        Kind.ERROR, id=0, error=f"version {self._loading} is loading: too late to withdraw"
                    )
                    _answer(channel, reply, message)
                else:
                    _answer(channel, self._handle(message), message)
        except CutOff as error:
            logger.warning("closing the control channel from %s: %s", channel.peer_host, error)
        except ProtocolError as error:
            logger.warning("control channel from %s broke the protocol: %s", channel.peer_host, error)
            _send_on(channel, make(Kind.ERROR, id=0, error=str(error)[:2000]))
        finally:
            # Closed first: a new control channel may take over (and ask for the status) while a load runs on.
            heartbeat.stop()
            channel.close()
            self._await_commit()
            with self._lock:
                if self._control is channel:
                    self._control = None
                    self._end_session()
                    self._drop_kept()

    def _start_commit(self, message: Message, channel: Channel) -> None:
        """Commit on a thread of its own: a load may outlast the sender's deadline, and the sender then asks what
        this replica serves (``status`` shows the version loading) instead of guessing. The answer goes only to
        the channel that asked (a new control channel's ids start again)."""
        self._loading = message["version"]

        def commit() -> None:
            try:
                reply = self._handle(message)
            finally:
                self._loading = -1
            _answer(channel, reply, message)

        self._committing = threading.Thread(target=commit, name="hex-commit", daemon=True)
        self._committing.start()

    def _await_commit_hearing(
        self, channel: Channel, silence_s: float, budget: FrameBudget, pending: deque[Message]
    ) -> None:
        """Wait for the commit loading now (before a request that needs it done) while still hearing ``channel``:
        a status is answered at once, other requests queue behind the waiting one (at most ``_READ_AHEAD``), and
        the channel is cut off when silent for ``silence_s``, as when nothing waits."""
        committing, heard = self._committing, time.monotonic()
        while committing is not None and committing.is_alive():
            if not channel.readable():
                if time.monotonic() - heard > silence_s:
                    raise _silent(silence_s)
                committing.join(_HEARING_S)
                continue
            message, heard = self._next_frame(channel, silence_s, budget), time.monotonic()
            if message is None:
                continue
            if message.kind == Kind.STATUS:
                _answer(channel, self._handle(message), message)
            elif len(pending) == _READ_AHEAD:
                raise CutOff(f"over its cap of {_READ_AHEAD} requests behind a load")
            else:
                pending.append(message)

    def _await_commit(self) -> None:
        """Wait until the commit loading now, asked on whichever control channel, is done (a channel that ends
        waits for it before it ends its session, and so does stop())."""
        committing = self._committing
        if committing is not None:
            committing.join()

    @staticmethod
    def _next_frame(channel: Channel, silence_s: float, budget: FrameBudget) -> Message | None:
        """The next request on the control channel (None for a heartbeat); every frame is counted against the
        sender's ``budget`` (requests are a handful per version), and a sender silent for ``silence_s`` is cut
        off."""
        try:
            message = channel.recv_within(_REQUESTS | {Kind.HEARTBEAT}, silence_s)
        except TimeoutError:
            raise _silent(silence_s) from None
        budget.spend()
        return None if message.kind == Kind.HEARTBEAT else message

    def _handle(self, message: Message) -> Message:
        handler = {
            Kind.PREPARE: self._on_prepare,
            Kind.CONNECT: self._on_connect,
            Kind.END: self._on_end,
            Kind.COMMIT: self._on_commit,
            Kind.ABORT: self._on_abort,
            Kind.STATUS: self._on_status,
        }[message.kind]
        try:
            return handler(message)
        except Exception as error:  # noqa: BLE001 - e.g. the sink's server refused; the sender must hear it
            logger.exception("%s failed", message.kind.value)
            return make(Kind.ERROR, id=0, error=f"{message.kind.value} failed on the replica: {error}"[:2000])

    def _current(self, message: Message) -> _Session | str:
        session = self._session
        if session is None or session.id != message["session"]:
            return f"{message.kind.value} for a session this replica is not in"
        if "version" in message.fields and message["version"] != session.version:
            return f"{message.kind.value} names version {message['version']}, the session is for {session.version}"
        return session

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            _close_all(session.take_forwarders())
            self._remove(session.stage)

    def _remove(self, stage: StagedVersion) -> None:
        if not stage.remove():
            self._leftovers.append(stage)

    def _remove_leftovers(self) -> None:
        leftovers, self._leftovers = self._leftovers, []
        for stage in leftovers:
            self._remove(stage)

    def _drop_kept(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            _close_all(kept[1])

    def _on_prepare(self, message: Message) -> Message:
        """Start a new session: drop whatever was staged and the old downstream link, and every data link from a
        host that is not upstream in the new one."""
        version, step = message["version"], self.config.max_version_step
        if version <= self.version:
            return make(
                Kind.ERROR, id=0, error=f"version {version} is not above the committed {self.version}"
            )
        if self.version >= 0 and version > self.version + step:
            return make(
                Kind.ERROR,
                id=0,
                error=f"version {version} is more than {step} above the committed {self.version}",
            )
        control = self._control
        assert control is not None
        named = [host for host in message["upstream"] if host]
        hosts = resolve_hosts(named) if named else set()
        if len(named) < len(message["upstream"]):
            hosts.add(control.peer_host)
        self._remove_leftovers()
        with self._lock:
            self._end_session()
            stage = StagedVersion(self.stage_root, version, self._spare)
            key = content_key(self.token, message["update"])
            self._session = _Session(message["session"], version, key, hosts, message["parts"], stage)
            self._session.seal_key = replica_key(control.key, message["session"])
            strangers = [channel for channel in self._data if channel.peer_host not in hosts]
        for channel in strangers:
            channel.close()
        return make(
            Kind.READY, id=0, version=self.version, server=str(getattr(self.sink, "server", ""))[:300]
        )

    def _on_connect(self, message: Message) -> Message:
        """Open one data link per part (lane) to the downstream neighbour (already prepared for the same
        session)."""
        session = self._current(message)
        if isinstance(session, str):
            return make(Kind.ERROR, id=0, error=session)
        downstream, backend = message["downstream"], message["backend"]
        _close_all(session.take_forwarders())
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            if (
                kept[0] == (downstream, backend)
                and len(kept[1]) == session.parts
                and all(forwarder.reusable() for forwarder in kept[1])
            ):
                session.downstream, session.forwarders = kept
                for forwarder in session.forwarders:
                    forwarder.session = session.id
                return make(Kind.CONNECTED, id=0)
            _close_all(kept[1])
        forwarders = []
        try:
            endpoint = Endpoint.parse(downstream)
            for _ in range(session.parts):
                channel, link = connect_data_link(
                    endpoint.host,
                    endpoint.port,
                    self.token,
                    session.id,
                    backend,
                    self.config.timeout_s,
                    self.device,
                )
                forwarders.append(_Forwarder(channel, link, downstream, session.id, self._report))
        except Exception as error:  # noqa: BLE001 - reported to the sender, which re-routes
            _close_all(forwarders)
            return make(Kind.DOWNSTREAM_FAILED, id=0, peer=downstream, error=str(error)[:2000])
        session.downstream, session.forwarders = (downstream, backend), forwarders
        return make(Kind.CONNECTED, id=0)

    def _on_end(self, message: Message) -> Message:
        """Seal the session (no bucket lands after this), then check what is staged against the trainer's
        sealed digest."""
        session = self._current(message)
        if isinstance(session, str):
            return make(Kind.ERROR, id=0, error=session)
        if not self._sealed_by_trainer(session, message):
            return make(Kind.ERROR, id=0, error="end: its seal is not the trainer's for this replica")
        with self._lock:
            if session.receiving:
                return make(Kind.ERROR, id=0, error=f"buckets {sorted(session.receiving)} are still arriving")
            session.sealed = True
        problem = self._check_staged(session, message["parts"], message["digest"])
        if problem:
            return make(Kind.ERROR, id=0, error=problem)
        session.announced, session.verified = message["parts"], message["digest"]
        return make(Kind.VERIFIED, id=0, digest=session.verified)

    def _sealed_by_trainer(self, session: _Session, message: Message) -> bool:
        expected = seal(session.seal_key, session.id, session.version, message["digest"])
        return hmac.compare_digest(expected, message["seal"])

    def _check_staged(self, session: _Session, announced: list[Any], digest: str) -> str:
        """What differs between the staged buckets (their digests, computed here as their bytes landed) and the
        version the trainer announced ('' when nothing)."""
        with self._lock:
            digests = dict(session.digests)
            staged = {
                index: (entries, data.numel()) for index, (entries, data) in session.stage.buckets.items()
            }
        problem = _check_parts(session, announced, digests, staged)
        if problem:
            return problem
        parts = [
            part_digest(
                session.key, part, [digests[bucket_index(part, session.parts, i)] for i in range(count)]
            )
            for part, (count, _, _) in enumerate(announced)
        ]
        wrong = [part for part, digest in enumerate(parts) if digest != announced[part][2]]
        if wrong:
            return f"part {wrong[0]}: digest differs from its sender's"
        if digest_of_version(session.key, session.version, parts) != digest:
            return "version digest differs from the sender's"
        return ""

    def _on_commit(self, message: Message) -> Message:
        session = self._current(message)
        if isinstance(session, str):
            return make(Kind.ERROR, id=0, error=session)
        if not session.verified or session.verified != message["digest"]:
            return make(Kind.ERROR, id=0, error="commit of a version this session did not verify")
        if not self._sealed_by_trainer(session, message):
            return make(Kind.ERROR, id=0, error="commit: its seal is not the trainer's for this replica")
        # Exactly what loads now: the verified bytes, in the files the server reads (see stage.py).
        problem = (
            self._check_staged(session, session.announced, session.verified) or session.stage.changed_files()
        )
        if problem:
            return make(
                Kind.ERROR, id=0, error=f"commit: the staged version changed after its end ({problem})"
            )
        with (
            self._lock
        ):  # every replica holds every bucket: the links are idle, and kept for the next version
            self._session = None
            self._drop_kept()
            self._kept = (session.downstream, session.forwarders)
            session.forwarders = []
        self._settle()  # the last committed version is wherever a failed load must find it
        self._spare.release()  # pages it gave up after this version was staged: the load holds one version
        try:
            self.sink.load(session.version, session.stage)
        except BaseException:
            self._remove(session.stage)  # the last committed version stays, and stays staged
            raise
        previous, self._last_committed = self._last_committed, session.stage
        self.version, self.digest = session.version, session.verified
        self._keeper = threading.Thread(  # off the commit's path: freeing and copying take a while
            target=self._keep, args=(previous, session.stage), name="hex-keeper", daemon=True
        )
        self._keeper.start()
        return make(Kind.COMMITTED, id=0, version=self.version)

    def _keep(self, previous: StagedVersion | None, current: StagedVersion) -> None:
        """Retire the version before the one just loaded, and move that one to the rollback dir (if any)."""
        if previous is not None and not previous.retire():
            self._leftovers.append(previous)
        if self.rollback_root is None:
            return
        try:
            current.spill(self.rollback_root)
        except (
            OSError
        ) as error:  # e.g. the disk is full: it stays in the stage dir, as without a rollback dir
            logger.warning(
                "cannot move version %s to %s (%s); it stays staged",
                current.directory.name,
                self.rollback_root,
                error,
            )

    def _settle(self) -> None:
        keeper = self._keeper
        if keeper is not None:
            keeper.join()

    def _on_abort(self, message: Message) -> Message:
        with self._lock:
            if self._session is not None and message["session"] in ("", self._session.id):
                self._end_session()
        return make(Kind.ABORTED, id=0)

    def _on_status(self, message: Message) -> Message:
        return make(
            Kind.STATE,
            id=0,
            version=self.version,
            digest=self.digest,
            loading=self._loading,
            **self._data_path(),
        )

    def _data_path(self) -> dict[str, int]:
        """Both ends of this replica's links in the current session (the sender's evidence of who stalls)."""
        session = self._session
        if session is None:
            return {"unread": 0, "backlog": 0, "unsent": 0}
        with self._lock:
            inbound, outbound = list(session.lanes.values()), list(session.forwarders)
        return {
            "unread": sum(_kernel_queue(channel.sock, termios.FIONREAD) for channel in inbound),
            "backlog": sum(forwarder.backlog for forwarder in outbound),
            "unsent": sum(forwarder.unsent() for forwarder in outbound),
        }

    # -- data ---------------------------------------------------------------------------------------------

    def _serve_data(self, channel: Channel, session_id: str) -> None:
        """Serve an incoming data link, for this session and the next ones (until it breaks or falls behind)."""
        session = self._session
        if session is None or session.id != session_id:
            return
        refusal, extra = self._admit_data(channel, session)
        if refusal:
            self._refuse(channel.sock, channel.peer_host, refusal)
            return
        try:
            self._carry(channel, extra)
        finally:
            with self._lock:
                self._data.pop(channel, None)

    def _admit_data(self, channel: Channel, session: _Session) -> tuple[str, bool]:
        """Why a new data link is refused ('' when it is taken): at most two per part of the session, and two,
        from one peer, and ``max_data_links`` in all; and whether it is beyond the one per part its peer's lanes
        need (then it must carry a bucket within the timeout)."""
        peer, most = channel.peer_host, 2 * session.parts + 2
        with self._lock:
            if self._stopping.is_set():
                return "the node is stopping", False
            if len(self._data) >= self.config.max_data_links:
                return f"{len(self._data)} data links are open (hex.relay max_data_links)", False
            open_links = sum(other.peer_host == peer for other in self._data)
            if open_links >= most:
                return (
                    f"{most} data links from this peer are open, as many as {session.parts} parts need",
                    False,
                )
            self._data[channel] = threading.current_thread()
        return "", open_links >= session.parts

    def _carry(self, channel: Channel, extra: bool) -> None:
        """Receive the link's buckets; an ``extra`` link that carries none within the timeout is closed."""
        deadline = time.monotonic() + self.config.timeout_s if extra else None
        channel.settimeout(self.config.timeout_s)
        link = open_receiving_link(channel, self.config.timeout_s, self.device)
        lane: tuple[_Session, int] | None = None  # the session and part this link carries now
        try:
            while True:
                if lane is None and deadline is not None:
                    header = channel.recv({Kind.BUCKET}, deadline)
                else:
                    channel.settimeout(None)  # idle between versions; a closed peer, or stop(), ends the wait
                    header = channel.recv({Kind.BUCKET})
                channel.settimeout(self.config.timeout_s)
                session = self._session
                if session is None or (header["session"], header["version"]) != (session.id, session.version):
                    return  # a link that is behind (or ahead of) the node's session is not kept
                if lane is None or lane[0] is not session:
                    self._release_lane(lane, channel)
                    lane = (session, self._claim_lane(session, channel, header["index"]))
                elif header["index"] % session.parts != lane[1]:
                    raise ProtocolError(
                        f"bucket {header['index']} is not of part {lane[1]}, which this link carries"
                    )
                self._receive_bucket(session, header, channel, link)
        except (OSError, ConnectionError, ValueError, RuntimeError) as error:
            self._upstream_lost(lane, error)
            raise
        finally:
            self._release_lane(lane, channel)
            link.close()

    def _upstream_lost(self, lane: tuple[_Session, int] | None, error: BaseException) -> None:
        """A link that carried part of the current session broke (was closed or reset, not merely silent: a
        stalled upstream is the trainer's to time out) before its end: the trainer repairs it."""
        session = self._session
        if isinstance(error, TimeoutError) or lane is None or lane[0] is not session:
            return
        if not session.sealed and not self._stopping.is_set():
            self._report(make(Kind.UPSTREAM_LOST, session=session.id, error=str(error)[:2000]))

    def _claim_lane(self, session: _Session, channel: Channel, index: int) -> int:
        """The part this link carries in ``session`` (its first bucket's); refused to a peer that is not the
        session's upstream (a link kept from an earlier route), and for a part another link carries."""
        if not self._peer_allowed(channel.peer_host, "data"):
            raise ProtocolError(
                f"{channel.peer_host} is not upstream of this replica in session {session.id}"
            )
        lane = index % session.parts
        with self._lock:
            if session.lanes.setdefault(lane, channel) is not channel:
                raise ProtocolError("a second data connection for one part")
        return lane

    def _release_lane(self, lane: tuple[_Session, int] | None, channel: Channel) -> None:
        if lane is not None:
            with self._lock:
                if lane[0].lanes.get(lane[1]) is channel:
                    del lane[0].lanes[lane[1]]

    def _receive_bucket(self, session: _Session, header: Message, channel: Channel, link: DataLink) -> None:
        """The bytes chunk by chunk (each forwarded and hashed as it lands), then the chunk digests to check."""
        index, nbytes = header["index"], header["nbytes"]
        chunk_count(header)
        entries = entries_from_manifest(header["manifest"])
        if entries[-1].offset + entries[-1].nbytes != nbytes:
            raise ProtocolError(f"bucket {index}: the manifest does not cover {nbytes} bytes")
        with self._lock:
            if session.sealed:  # after end: what the trainer sealed is what stays staged
                raise ProtocolError(f"bucket {index} after the end of session {session.id}")
            if index in session.receiving:
                raise ProtocolError(f"bucket {index} is arriving on another link")
            session.receiving.add(index)
        try:
            ok, arrived = self._receive_into_stage(session, header, channel, link, entries)
        finally:
            with self._lock:
                session.receiving.discard(index)
        # Acknowledged once no longer arriving: the end that may follow at once finds it settled. The whole copy
        # arrived: its size and the digest of what arrived are the evidence of a NACK.
        self._report(
            make(
                Kind.ACK,
                session=session.id,
                index=index,
                copy=header["copy"],
                ok=ok,
                error="",
                received=nbytes,
                digest=arrived,
            )
        )

    def _refuse_bucket(self, session: _Session, header: Message, error: Exception) -> ConnectionError:
        """Tell the sender why this replica cannot take the bucket (e.g. its stage dir is full); the data link
        ends."""
        index, copy = header["index"], header["copy"]
        self._report(
            make(
                Kind.ACK,
                session=session.id,
                index=index,
                copy=copy,
                ok=False,
                error=str(error)[:2000],
                received=0,
                digest="",
            )
        )
        return ConnectionError(f"bucket {index} refused: {error}")

    def _receive_into_stage(
        self, session: _Session, header: Message, channel: Channel, link: DataLink, entries: list[Any]
    ) -> tuple[bool, str]:
        """Stage, forward and hash the bucket's bytes; whether its chunk digests match, and the bucket digest of
        what arrived."""
        index, nbytes, step = header["index"], header["nbytes"], header["chunk"]
        forwarder = session.forwarders[index % session.parts] if session.forwarders else None
        if forwarder is not None:
            forwarder.put("frame", header)
        try:
            session.stage.allocate(index, header["copy"], entries, nbytes)
            landing = session.stage.landing(index, step)
        except Exception as error:
            raise self._refuse_bucket(session, header, error) from error
        ok, chunks, computed = False, [], []
        try:  # a bucket that does not arrive whole and verified is not kept
            hashed = []
            try:
                for chunk_index, piece in enumerate(link.receive(landing)):
                    if forwarder is not None:
                        forwarder.put("chunk", piece)
                    hashed.append(hash_chunk(session.key, index, chunk_index, piece))
            except HexError as error:  # the stage dir filled up under this bucket
                raise self._refuse_bucket(session, header, error) from error
            sent = channel.recv({Kind.DIGESTS})
            chunks = sent["chunks"]
            if dict(sent.fields) != dict(digests_after(header, chunks).fields) or len(chunks) != len(hashed):
                raise ProtocolError(f"bucket {index}: its digests frame does not match its header and size")
            if forwarder is not None:
                forwarder.put("frame", sent)
            computed = [future.result() for future in hashed]
            ok = computed == chunks
        finally:
            with self._lock:
                if ok:
                    session.digests[index] = bucket_digest(
                        session.key, index, header["manifest"], step, chunks
                    )
                else:
                    session.digests.pop(index, None)
                    session.stage.drop(index)
        return ok, bucket_digest(session.key, index, header["manifest"], step, computed)


def _check_parts(
    session: _Session,
    parts: list[list[Any]],
    digests: dict[int, str],
    staged: dict[int, tuple[list[Any], int]],
) -> str:
    """What is wrong with the version ``end`` announces against what this node verified ('' when nothing):
    every part has exactly its announced buckets, verified, of its announced size, and no tensor comes twice."""
    if len(parts) != session.parts:
        return f"parts: {len(parts)} announced, the session has {session.parts}"
    if sum(count for count, _, _ in parts) == 0:
        return "buckets: the version has none"
    for part, (count, nbytes, _) in enumerate(parts):
        held = sorted(index for index in digests if index % session.parts == part)
        expected = [bucket_index(part, session.parts, i) for i in range(min(count, len(held) + 5))]
        if len(held) != count or held != expected:
            missing = sorted(set(expected) - set(held))[:5]
            shown = f" (missing {missing})" if missing else ""
            return f"part {part}: buckets: {count} announced, {len(held)} verified{shown}"
        size = sum(staged[index][1] for index in held)
        if size != nbytes:
            return f"part {part}: nbytes: {nbytes} announced, {size} staged"
    extra = sorted(set(staged) - set(digests))[:5]
    if extra:
        return f"buckets {extra} are staged but not verified"
    names: set[str] = set()
    for index in sorted(staged):
        for entry in staged[index][0]:
            if entry.name in names:
                return f"tensor {entry.name} arrives in two buckets"
            names.add(entry.name)
    return ""


def _silent(silence_s: float) -> CutOff:
    return CutOff(f"silent for {silence_s:g} s ({SILENT_HEARTBEATS} heartbeats)")


def _answer(control: Channel, reply: Message, request: Message) -> None:
    """Answer ``request`` on the control channel it came on (never on one that took over since)."""
    _send_on(control, _with_id(reply, request))


def _send_on(control: Channel, message: Message) -> None:
    """Send ``message`` on a control channel; one that fails (e.g. its trainer took nothing for 3 heartbeats, or
    it was closed meanwhile) is closed."""
    try:
        control.send(message)
    except OSError:
        logger.info("control channel lost while sending %s", message.kind.value)
        control.close()


def _with_id(reply: Message, request: Message) -> Message:
    return make(reply.kind, **{**reply.fields, "id": request["id"]})
