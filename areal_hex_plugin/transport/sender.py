"""The trainer side: push a version's buckets along the route, re-send bad ones, re-route around failures,
verify every replica's digest, then commit everywhere (two phases, so no replica ever mixes versions).

A version may come in parts from several senders (each FSDP rank, each Megatron pipeline stage sends its own
share, so no one NIC carries the model to every pool): :class:`RelaySender` is part 0 and the coordinator (it alone
holds the control channels: prepare, verify, commit), each other part is a :class:`PartSender` that opens its own
data links to every pool's relay in the coordinator's sessions (:meth:`RelaySender.assignment`) and hands back a
:class:`PartSummary`; the coordinator waits for every part's buckets on every replica (:meth:`RelaySender.settle`)
and verifies each part's digest and the version's. What another sender must send again (a bucket of its part that
failed its checksum, every bucket after a pool was re-routed to a new session) comes back from ``settle`` as a
repair plan for :meth:`PartSender.repair`, round after round until nothing is missing. A relay that another
sender's data link cannot reach counts as failed, as one this process's own link cannot reach (re-routed under
``on_failure: reroute``).

Blame needs proof: a replica reports only what it can observe, and a report the sender can show to be false routes
the reporter out and excludes it for the rest of this sender's life (its later versions), never the replica it
names. A FORWARD_FAILED must name the reporter's own downstream (a tail has none); a NACK must be for a copy that
reached the reporter (the sender handed it to the relay whole, or the reporter's upstream reported on it), carry the
copy's size as the bytes received and a digest of what arrived that differs from the sender's. A FORWARD_FAILED
about the reporter's real downstream is a claim the downstream's own view decides: its UPSTREAM_LOST starts a repair
round; its acknowledging every bucket (each with the digest of the right bytes, which only the reporter forwarded
to it) proves the claim false; a stall with the claim open disputes the link. A pool that stops making progress is
asked, on both ends of the link into its first replica that lacks buckets, who holds the bytes: an upstream that
holds bytes to forward while its socket and its downstream wait is the one routed out, a downstream that leaves
bytes unread is; an upstream's figures that would clear it (nothing held, or a downstream that does not take its
bytes while that downstream has none unread) are its own word against the downstream's, so the link is disputed.

An end is routed out only on evidence it cannot have been framed by: its own figures or reports against itself,
a claim refuted by what the sender checks (its digests, what it sent), or a link from this sender. A link whose
ends disagree, that breaks ``max_resends`` times, or that delivers a bucket corrupted ``max_resends`` times from an
upstream that acknowledged it whole (both ends hold the content key, so a downstream can make up the digest of
what arrived as easily as an upstream can forward other bytes than it holds) is disputed instead: its ends are
separated, the downstream moved to the front of the chain (fed by this sender, which is trusted) and the upstream
to the back (it feeds nobody), for this version and the later ones. A replica disputed with a second peer is the
common end and is excluded; a pair disputed again after separation (a chain of two) cannot be decided by any
evidence here, so both ends are routed out, never only the one named.

The commit has one deadline for all replicas, asked at once. A replica that has not answered by then is in doubt:
it is sent an ``abort`` (a node that finds an abort queued behind a commit withdraws the commit) and asked for its
``status`` (over a new control channel if its own was lost), until it has finished loading or the grace is over;
the report tells each such replica's outcome as it showed it: "switched", "kept: ..." or "unknown: check server
..." (:attr:`UpdateReport.outcomes`), and only a switched one counts as committed."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.config import check_relay_sender
from areal_hex_plugin.transport.buckets import (
    Bucket,
    bucket_index,
    content_key,
    pack,
    part_digest,
    replica_key,
    seal,
    version_digest,
)
from areal_hex_plugin.transport.links import DataLink, check_backend, connect_data_link, current_device
from areal_hex_plugin.transport.protocol import (
    MAX_HEARTBEAT_MS,
    MAX_HOSTS,
    MAX_PARTS,
    MIN_CHUNK_BYTES,
    MIN_HEARTBEAT_MS,
    PROTOCOL_VERSION,
    SILENT_HEARTBEATS,
    Kind,
    Message,
    digests_after,
    make,
)
from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
from areal_hex_plugin.transport.wire import (
    Channel,
    CutOff,
    FrameBudget,
    Heartbeat,
    TransportError,
    connect,
    load_token,
)

logger = logging.getLogger("HexTransportSender")


@dataclass
class SenderConfig:
    backend: str = "tcp"
    # A replica that sends nothing for this long, or a link that stops moving, counts as dead.
    timeout_s: float = 30.0
    chunk_bytes: int = 4 << 20
    # "reroute": drop the dead replica, make the next one relay, re-send to that pool; "fail": abort everywhere.
    on_failure: str = "reroute"
    max_resends: int = 3
    # One deadline for every replica's commit (each loads the version into its server), and the grace for the
    # status of those in doubt after it.
    commit_timeout_s: float = 300.0
    # Both ends of each control channel send a heartbeat this often (the trainer announces it); a channel silent
    # for 3 of them is closed at either end, so a restarted trainer takes a replica over within that.
    heartbeat_s: float = 5.0

    def __post_init__(self) -> None:
        check_relay_sender(self.backend, self.on_failure, self.timeout_s, self.chunk_bytes, self.max_resends)
        check_backend(self.backend)  # nccl also needs CUDA here
        if not MIN_HEARTBEAT_MS <= self.heartbeat_s * 1000 <= MAX_HEARTBEAT_MS:
            raise HexError(
                "SenderConfig.heartbeat_s",
                f"{self.heartbeat_s!r} s is outside [{MIN_HEARTBEAT_MS / 1000:g}, {MAX_HEARTBEAT_MS / 1000:g}] s",
                "use e.g. 5 (a silent control channel is then closed within 15 s)",
            )
        if self.chunk_bytes < MIN_CHUNK_BYTES or self.commit_timeout_s <= 0:
            raise HexError(
                "hex.relay",
                f"chunk_bytes {self.chunk_bytes} below {MIN_CHUNK_BYTES}, or commit_timeout_s {self.commit_timeout_s} <= 0",
                "use chunks of at least 4 KiB (hex.relay.chunk_mb) and a positive commit deadline",
            )


@dataclass
class UpdateReport:
    version: int
    digest: str
    nbytes: int
    seconds: float
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    resent_buckets: int = 0
    reroutes: int = 0
    # Seconds since begin() at the end of each phase: prepared, queued (last bucket handed over), received
    # (every replica acknowledged every bucket), verified, committed.
    phases: dict[str, float] = field(default_factory=dict)
    # The update's nonce: with the token it gives the content key, so whoever holds the token can recompute
    # ``digest`` from a copy of the weights, the buckets' manifests and the number of parts (an audit of what a
    # replica holds).
    update: str = ""
    # The replicas whose commit was in doubt, by what they showed afterwards: "switched" (also in ``committed``),
    # "kept: ..." or "unknown: check server ...: ..." (also in ``failed``).
    outcomes: dict[str, str] = field(default_factory=dict)

    def mark(self, phase: str, began: float) -> None:
        self.phases[phase] = round(time.perf_counter() - began, 4)


_EVENTS = (Kind.ACK, Kind.FORWARD_FAILED, Kind.UPSTREAM_LOST)


class _Control:
    """The sender's control channel to one node; replies queue up, events go to the shared queue.

    Only what the sender may be waiting for is kept: a reply to a request still unanswered, an event the sender
    expects (its pool's current session, a bucket copy that was sent), each once, and of the events its ``judge``
    proves false (an acknowledgement of a copy never sent) the first of each session, as the proof that routes the
    node out. Everything else is dropped and counted against a :class:`FrameBudget`; a node over it, or silent for
    three heartbeats, is cut off."""

    def __init__(
        self,
        endpoint: Endpoint,
        pool: str,
        token: bytes,
        config: SenderConfig,
        events: queue.Queue,
        judge: Callable[[Message], str | None],
    ) -> None:
        self.endpoint, self.pool, self.timeout_s = endpoint, pool, config.timeout_s
        self.channel = connect(endpoint.host, endpoint.port, token, config.timeout_s)
        heartbeat_ms = round(config.heartbeat_s * 1000)
        try:
            self.channel.send(
                make(
                    Kind.HELLO, role="control", proto=PROTOCOL_VERSION, session="", heartbeat_ms=heartbeat_ms
                )
            )
        except OSError as error:
            self.channel.close()
            raise TransportError(f"control connection to {endpoint} broke at once ({error})") from error
        self._silence_s = SILENT_HEARTBEATS * config.heartbeat_s
        self.channel.settimeout(self._silence_s)  # a send the node does not take by then ends the channel too
        self.replies: queue.Queue[Message] = queue.Queue()
        self.closed = False
        self.lost = False  # the connection broke (e.g. the node restarted): the next version opens a new one
        self.server = (
            ""  # the replica's server as its node names it (what to check when a commit is in doubt)
        )
        self._last_id = 0
        self._events, self._judge = events, judge
        self._asked: set[int] = set()  # requests not answered yet
        self._asked_lock = threading.Lock()
        self._session, self._seen = "", set[tuple[Any, ...]]()  # the events kept, of that session
        self._budget = FrameBudget()
        self._heartbeat = Heartbeat(self.channel, config.heartbeat_s)
        threading.Thread(target=self._read, name=f"hex-control-{endpoint}", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                try:
                    message = self.channel.recv_within(None, self._silence_s)
                except TimeoutError:
                    raise CutOff(f"silent for {self._silence_s:g} s (3 heartbeats)") from None
                if not self._keep(message):
                    self._budget.spend()
        except (OSError, ConnectionError, ValueError, RuntimeError) as error:
            self.lost = True
            self._heartbeat.stop()
            if not self.closed:
                if isinstance(error, CutOff):
                    logger.warning("%s: closing its control channel: %s", self.endpoint, error)
                self.channel.close()
                lost = _lost(f"control connection lost ({error})")
                self._events.put((self.pool, self.endpoint, lost))
                self.replies.put(lost)

    def _keep(self, message: Message) -> bool:
        """Queue ``message`` if the sender may be waiting for it; False (dropped) otherwise."""
        if message.kind in _EVENTS:
            lie = self._judge(message)
            if lie is None:
                return False
            if message["session"] != self._session:
                self._session, self._seen = message["session"], set()
            seen = ("lie",) if lie else _event_key(message)  # one proof a session is enough to route it out
            if seen in self._seen:
                return False
            self._seen.add(seen)
            # Judged as it arrives: a copy sent later does not make an earlier report of it true.
            self._events.put((self.pool, self.endpoint, _false_report(lie) if lie else message))
            return True
        request = message.fields.get("id")
        with self._asked_lock:
            if request not in self._asked and not (request == 0 and self._asked):
                return False
            if request == 0:  # the node refused the channel itself: the answer to every request
                self._asked.clear()
            else:
                self._asked.discard(request)
        self.replies.put(message)
        return True

    def send(self, kind: Kind, **fields: Any) -> int:
        """Send a request tagged with a fresh id (the node echoes it); returns the id to await."""
        self._last_id += 1
        with self._asked_lock:
            self._asked.add(self._last_id)
        try:
            self.channel.send(make(kind, id=self._last_id, **fields))
        except OSError as error:
            self.replies.put(_lost(f"control connection lost ({error})"))
        return self._last_id

    def reply(
        self, request_id: int, timeout_s: float | None = None, deadline: float | None = None
    ) -> Message:
        """The answer to ``request_id`` (by ``deadline`` if given); late answers to earlier requests are
        discarded."""
        if deadline is None:
            deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            try:
                reply = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return _lost("no answer in time")
            if reply.fields.get("id") in (request_id, -1):
                return reply
            if reply.kind == Kind.ERROR and reply["id"] == 0:  # the node refused the channel itself
                return reply
            logger.info(
                "%s: discarding a late %s reply to request %s", self.endpoint, reply.kind.value, reply["id"]
            )

    def request(self, kind: Kind, **fields: Any) -> Message:
        return self.reply(self.send(kind, **fields))

    def seal(self, session: str, version: int, digest: str) -> str:
        """The version digest's MAC for this replica alone (keyed by this control channel's key)."""
        return seal(replica_key(self.channel.key, session), session, version, digest)

    def close(self) -> None:
        self.closed = True
        self._heartbeat.stop()
        self.channel.close()


@dataclass
class PartSummary:
    """What one sender sent of a version: ``buckets`` as [index, bucket digest, nbytes], and the pools whose relay
    its data link could not reach or lost in the last round (pool -> error)."""

    part: int
    buckets: list[list[Any]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.buckets)


LINK_LOSS_GRACE_S = 0.5


def _lost(error: str) -> Message:
    """A local stand-in for an answer that never came (id -1 matches every request)."""
    return Message(Kind.ERROR, {"error": error, "id": -1, "lost": True})


def _event_key(event: Message) -> tuple[Any, ...]:
    """What makes an event from a node new: its kind and, for an acknowledgement, the bucket copy."""
    return event.kind, event.fields.get("index"), event.fields.get("copy")


def _false_report(lie: str) -> Message:
    """A local stand-in for an event the sender proved false as it arrived (``lie`` says how)."""
    return Message(Kind.ERROR, {"error": lie, "false": True})


def _error(reply: Message) -> str:
    return reply.fields.get("error", reply.kind.value)


class _PoolPush:
    """Feeds one pool's relay on a thread of its own, so every pool's cross link is busy at once."""

    def __init__(self, channel: Channel, link: DataLink, relay: Endpoint, pool: str, events: queue.Queue):
        self.channel, self.link, self.relay, self.pool, self.events = channel, link, relay, pool, events
        self.work: queue.Queue[tuple[Message, Bucket, int] | threading.Event | None] = queue.Queue()
        self.broken = False
        self.sent: dict[tuple[str, int], int] = {}  # (session, bucket) -> the last copy handed over whole
        self.thread = threading.Thread(target=self._run, name=f"hex-push-{pool}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.work.get()) is not None:
            try:
                if isinstance(item, threading.Event):  # flush(): everything before it is handed over
                    item.set()
                elif not self.broken:
                    self._send(*item)
            finally:
                self.work.task_done()

    def _send(self, header: Message, bucket: Bucket, step: int) -> None:
        try:
            self.channel.send(header)
            for offset in range(0, bucket.nbytes, step):
                bucket.wait_filled(min(offset + step, bucket.nbytes))  # sent as it is packed
                self.link.send(bucket.data[offset : offset + step])
            self.channel.send(digests_after(header, bucket.chunks))  # hashed while the bytes went out
            self.sent[(header["session"], header["index"])] = header["copy"]
        except Exception as error:  # noqa: BLE001 - reported as a failure of the relay
            self.broken = True
            # A relay that refuses a bucket (e.g. a full stage dir) says why on the control channel, then
            # ends this link: let its reason reach the events first, as the one worth reporting.
            time.sleep(LINK_LOSS_GRACE_S)
            self.events.put((self.pool, self.relay, _lost(f"data link to relay broke ({error})")))

    def reusable(self, relay: Endpoint) -> bool:
        """For the next version to ``relay``: the same relay, everything queued went out, never broken, and the
        relay has not closed the link (a broken one is never reused: a new one is opened)."""
        return (
            relay == self.relay
            and not self.broken
            and self.work.unfinished_tasks == 0
            and not self.channel.peer_closed()
        )

    def flush(self) -> None:
        """Wait until every queued bucket went out (or the link broke: each send has the link's timeout)."""
        done = threading.Event()
        self.work.put(done)
        done.wait()

    def close(self) -> None:
        self.work.put(None)
        self.thread.join(timeout=5)
        self.link.close()
        self.channel.close()


def _header(session: str, version: int, bucket: Bucket, copy: int) -> Message:
    return make(
        Kind.BUCKET,
        session=session,
        version=version,
        index=bucket.index,
        copy=copy,
        nbytes=bucket.nbytes,
        chunk=bucket.chunk,
        manifest=bucket.manifest(),
    )


@dataclass
class _Repair:
    """What the other parts must send one pool again: everything (a new session), or these bucket copies."""

    all: bool = False
    resend: dict[int, int] = field(default_factory=dict)


@dataclass
class _PoolState:
    route: PoolRoute
    # The chain's order for every version (the route's, until the ends of a disputed link are separated), and
    # this version's replicas in it.
    order: list[Endpoint]
    alive: list[Endpoint]
    controls: dict[Endpoint, _Control] = field(default_factory=dict)
    push: _PoolPush | None = None
    session: str = ""
    acked: dict[int, set[Endpoint]] = field(default_factory=dict)
    # The latest copy of each bucket sent; a NACK of an older copy is stale.
    copies: dict[int, int] = field(default_factory=dict)
    # Who reported on each (bucket, copy), and NACKs waiting until their copy has reached the reporter.
    reports: dict[tuple[int, int], set[Endpoint]] = field(default_factory=dict)
    deferred: list[tuple[Endpoint, Message]] = field(default_factory=list)
    # Replicas whose upstream said its forward to them failed, by that upstream: judged by what they show.
    claims: dict[Endpoint, Endpoint] = field(default_factory=dict)


class RelaySender:
    """Send versions along a :class:`Route`.

    ``begin(v)``, then ``send_bucket(named_tensors)`` for every bucket as the trainer produces it, then
    ``finish()`` (verify and commit), or ``send_version(v, buckets)`` for all three. With ``parts`` > 1 this is
    part 0 of the version; ``sender_hosts`` are the addresses the relays see the senders of every part connect from
    ("" for this process's own, as its control channel shows it), and ``finish(parts=...)`` takes the other parts'
    summaries.
    """

    def __init__(
        self,
        route: Route,
        config: SenderConfig | None = None,
        token: bytes | None = None,
        parts: int = 1,
        sender_hosts: Iterable[str] = ("",),
    ) -> None:
        self.route = route
        self.config = config or SenderConfig()
        self.token = token if token is not None else load_token()
        self._parts, self._sender_hosts = parts, sorted(set(sender_hosts))
        if not 1 <= parts <= MAX_PARTS or not 1 <= len(self._sender_hosts) <= MAX_HOSTS:
            raise HexError(
                "hex.relay",
                f"{parts} senders from {len(self._sender_hosts)} hosts",
                f"send a version in 1 to {MAX_PARTS} parts from 1 to {MAX_HOSTS} hosts",
            )
        self._events: queue.Queue[tuple[str, Endpoint, dict[str, Any]]] = queue.Queue()
        self._pools = {
            pool.name: _PoolState(pool, list(pool.replicas), list(pool.replicas)) for pool in route.pools
        }
        self._failed: dict[str, str] = {}
        # Replicas caught reporting falsely: left out of every later version of this sender (replica -> why).
        self._excluded: dict[Endpoint, str] = {}
        # The peers each replica was at either end of a disputed link with (this sender's life).
        self._disputes: dict[Endpoint, set[Endpoint]] = {}
        self._buckets: dict[int, Bucket] = {}  # this part's, by version-wide index
        self._remote: list[PartSummary] = []
        # What other parts must send again, per pool: every bucket (a new session) or some copies.
        self._repairs: dict[str, _Repair] = {}
        self._version = -1
        self._update = ""
        self._key = b""
        self._device = current_device()
        self._began = 0.0
        self._report: UpdateReport | None = None
        self._sending = False  # from begin() until the version is committed or aborted

    # -- public -------------------------------------------------------------------------------------------

    def send_version(
        self, version: int, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]
    ) -> UpdateReport:
        self.begin(version)
        for named_tensors in buckets:
            self.send_bucket(named_tensors)
        return self.finish()

    def begin(self, version: int) -> None:
        self._version, self._buckets, self._remote = version, {}, []
        self._update = secrets.token_hex(32)
        self._key = content_key(self.token, self._update)
        self._began = time.perf_counter()
        self._report = UpdateReport(version, "", 0, 0.0, update=self._update)
        self._sending = True
        self._drain_events()
        self._failed = {str(e): f"excluded: {why}" for e, why in self._excluded.items()}
        self._link_repairs: dict[Endpoint, int] = {}
        for state in self._pools.values():
            # Replicas that failed an earlier version are tried again (a recovered one gets this version whole),
            # except those caught lying.
            state.alive = [e for e in state.order if e not in self._excluded]
            if not state.alive:
                self.abort()
                raise TransportError(
                    f"weight update to version {version} failed: every replica of pool {state.route.name!r} is "
                    f"excluded for false reports ({self._failed}); all keep their previous version"
                )
            self._prepare(state, keep_link=True)
        self._report.mark("prepared", self._began)

    def send_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pin = self._device.type == "cuda"

        def ready(bucket: Bucket) -> None:  # every pool's relay gets the bytes while they are packed
            self._buckets[bucket.index] = bucket
            for state in self._pools.values():
                self._enqueue(state, bucket)

        index = bucket_index(0, self._parts, len(self._buckets))
        pack(index, named_tensors, self._key, self.config.chunk_bytes, pin, ready)

    def assignment(self) -> dict[str, Any]:
        """What a :class:`PartSender` needs for this version (after :meth:`begin`; plain data to broadcast)."""
        return {
            "version": self._version,
            "update": self._update,
            "parts": self._parts,
            "backend": self.config.backend,
            "chunk_bytes": self.config.chunk_bytes,
            "timeout_s": self.config.timeout_s,
            "pools": {
                name: {"session": state.session, "relay": str(state.alive[0])}
                for name, state in self._pools.items()
            },
        }

    def summary(self) -> PartSummary:
        """This process's own part (part 0) so far."""
        return PartSummary(0, [[i, b.digest(self._key), b.nbytes] for i, b in self._buckets.items()])

    def settle(self, parts: Iterable[PartSummary] = ()) -> dict[str, Any] | None:
        """Wait until every live replica holds every bucket of every part (``parts``: the summaries of parts 1
        and up), re-sending this part's own; returns what the other parts must send again (for
        :meth:`PartSender.repair`), or None when nothing is missing. Raises (after aborting everywhere) when the
        version cannot be completed."""
        try:
            self._remote = self._check_parts(list(parts))
            self._repairs = {}
            for summary in self._remote:
                for pool, error in summary.failed.items():
                    state = self._pools[pool]
                    reason = f"data link from the sender of part {summary.part} to relay broke ({error})"
                    self._reroute(state, reason, state.alive[0])
            self._await_buckets()
        except BaseException:
            self.abort()
            raise
        if not self._repairs:
            return None
        pools = {}
        for name, repair in self._repairs.items():
            state = self._pools[name]
            pools[name] = {
                "session": state.session,
                "relay": str(state.alive[0]),
                "all": repair.all,
                "resend": sorted(repair.resend.items()),
            }
        return {"pools": pools}

    def finish(self, commit: bool = True, parts: Iterable[PartSummary] = ()) -> UpdateReport:
        """Wait until every live replica holds every bucket of every part (``parts``: the summaries of parts 1
        and up, after :meth:`settle` needs no repair), verify digests, then commit (unless told not to)."""
        report = self._report
        assert report is not None, "begin() first"
        report.mark("queued", self._began)
        if self.settle(parts) is not None:
            self.abort()
            raise TransportError(
                f"weight update to version {self._version}: other parts must be sent again, so finish "
                f"after settle() returns None (their senders repair what it returns)"
            )
        try:
            report.mark("received", self._began)
            summaries = [self.summary(), *self._remote]
            report.digest = version_digest(
                self._key, self._version, [self._part_digest(summary) for summary in summaries]
            )
            self._verify(report.digest, summaries)
            report.mark("verified", self._began)
        except BaseException:
            self.abort()
            raise
        report.nbytes = sum(summary.nbytes for summary in summaries)
        if commit:
            self.commit()
        report.seconds = time.perf_counter() - self._began
        report.failed = dict(self._failed)
        return report

    @property
    def last_report(self) -> UpdateReport | None:
        return self._report

    def commit(self) -> None:
        """Second phase, after :meth:`finish` with ``commit=False``: every verified replica switches over, all
        asked at once under one deadline; the ones in doubt after it are reconciled with ``status``."""
        report = self._report
        assert report is not None
        pending = {
            control: (
                state,
                control.send(
                    Kind.COMMIT,
                    session=state.session,
                    version=self._version,
                    digest=report.digest,
                    seal=control.seal(state.session, self._version, report.digest),
                ),
            )
            for state in self._pools.values()
            for control in self._live_controls(state)
        }
        deadline = time.monotonic() + self.config.commit_timeout_s
        in_doubt = []
        for control, (state, request_id) in pending.items():
            reply = control.reply(request_id, deadline=deadline)
            if reply.kind == Kind.COMMITTED and reply["version"] == self._version:
                report.committed.append(str(control.endpoint))
            elif reply.fields.get("lost"):
                in_doubt.append((control, state))
            else:  # the others have switched already: record it, the caller decides what is enough
                self._drop(state, control.endpoint, f"commit failed: {_error(reply)}")
        self._reconcile(in_doubt, report)
        report.mark("committed", self._began)
        report.failed = dict(self._failed)
        self._buckets, self._remote, self._sending = {}, [], False

    def _reconcile(self, in_doubt: list[tuple[_Control, _PoolState]], report: UpdateReport) -> None:
        """Withdraw the commit from replicas that did not answer, then report (and route by) what each shows."""
        for control, state in in_doubt:
            control.send(Kind.ABORT, session=state.session)
        deadline = time.monotonic() + min(self.config.timeout_s, 5.0)
        for control, state in in_doubt:
            outcome = self._outcome(self._served(state, control, deadline), control, report.digest)
            report.outcomes[str(control.endpoint)] = outcome
            if outcome == "switched":
                report.committed.append(str(control.endpoint))
            else:
                self._drop(state, control.endpoint, outcome)

    def _served(self, state: _PoolState, control: _Control, deadline: float) -> Message:
        """The replica's status by ``deadline``, asked again while it is still loading; over a new control
        channel if its own was lost (a reply lost on the way is no answer); the last status if a later one
        does not come."""
        last: Message | None = None
        while True:
            if control.lost:
                try:
                    control = self._reopen(state, control)
                except (TransportError, OSError) as error:
                    return _lost(f"the replica is unreachable ({error})")
            reply = control.reply(control.send(Kind.STATUS), deadline=deadline)
            if reply.kind != Kind.STATE:
                return reply if last is None else last
            if reply["loading"] < 0 or time.monotonic() >= deadline:
                return reply
            last = reply
            time.sleep(0.1)

    def _reopen(self, state: _PoolState, control: _Control) -> _Control:
        """A new control channel to a replica whose own was lost (within the status grace)."""
        control.close()
        fresh = self._open_control(state, control.endpoint, min(self.config.timeout_s, 5.0))
        fresh.server = control.server
        return fresh

    def _open_control(self, state: _PoolState, endpoint: Endpoint, timeout_s: float) -> _Control:
        """A control channel to ``endpoint`` of ``state``'s pool (blocking calls bounded by ``timeout_s``), kept
        in the pool's controls."""
        state.controls[endpoint] = control = _Control(
            endpoint,
            state.route.name,
            self.token,
            replace(self.config, timeout_s=timeout_s),
            self._events,
            lambda message: self._judge(state, message),
        )
        return control

    def _outcome(self, reply: Message, control: _Control, digest: str) -> str:
        """What a replica whose commit was in doubt serves, as its status shows it, never a guess."""
        late = f"commit not done within {self.config.commit_timeout_s:.0f} s"
        server = control.server or f"of replica {control.endpoint}"
        if reply.kind != Kind.STATE:
            return f"unknown: check server {server}: {late} and no status ({_error(reply)})"
        if (reply["version"], reply["digest"]) == (self._version, digest):
            return "switched"
        if reply["loading"] >= 0:
            return f"unknown: check server {server}: {late}, still loading version {reply['loading']}"
        return f"kept: {late}; withdrawn, the replica serves version {reply['version']}"

    def abort(self) -> None:
        """Every replica drops the staged version and keeps serving its last committed one."""
        for state in self._pools.values():
            self._stop_push(state)
            for control in self._live_controls(state):
                control.request(Kind.ABORT, session=state.session)
        self._buckets, self._remote, self._sending = {}, [], False

    def status(self) -> dict[str, dict[str, Any]]:
        """Committed version and digest of every live replica (asked at once)."""
        asked = [
            (control, control.send(Kind.STATUS))
            for state in self._pools.values()
            for control in self._live_controls(state)
        ]
        answers = {}
        for control, request_id in asked:
            reply = control.reply(request_id)
            answers[str(control.endpoint)] = {"t": reply.kind.value, **reply.fields}
        return answers

    def close(self) -> None:
        for state in self._pools.values():
            self._stop_push(state)
            for control in state.controls.values():
                control.close()
            state.controls.clear()

    # -- internals ----------------------------------------------------------------------------------------

    def _judge(self, state: _PoolState, event: Message) -> str | None:
        """What ``event`` from a replica of ``state``'s pool is: None when the replica has no reason to send it (not
        of the pool's current session while a version is on its way), '' when it may, or what proves it false: an
        acknowledgement of a bucket copy never sent into the pool (this part's buckets as copied; another part's
        as its first copy or one a repair asked for)."""
        if not self._sending or event["session"] != state.session:
            return None
        if event.kind != Kind.ACK:
            return ""
        index, copy = event["index"], event["copy"]
        if copy <= state.copies.get(index, -1 if index % self._parts == 0 else 0):
            return ""
        return f"{'ACKed' if event['ok'] else 'NACKed'} copy {copy} of bucket {index}, which was never sent"

    def _live_controls(self, state: _PoolState) -> list[_Control]:
        return [state.controls[e] for e in state.alive if e in state.controls]

    def _drain_events(self) -> None:
        while not self._events.empty():
            self._events.get_nowait()

    def _stop_push(self, state: _PoolState) -> None:
        if state.push is not None:
            state.push.close()
            state.push = None

    def _drop(self, state: _PoolState, endpoint: Endpoint, reason: str) -> bool:
        """Take a replica out of this version's route; False if it was out already."""
        if endpoint not in state.alive:
            return False
        logger.warning("pool %s: replica %s failed: %s", state.route.name, endpoint, reason)
        state.alive.remove(endpoint)
        self._failed[str(endpoint)] = reason
        if state.push is not None and state.push.relay == endpoint:
            self._stop_push(state)
        control = state.controls.pop(endpoint, None)
        if control is not None:
            control.close()
        return True

    def _mark_failed(self, state: _PoolState, endpoint: Endpoint, reason: str) -> None:
        """Before commit: drop the replica, then re-route or (``on_failure=fail``, or none left) abort and raise."""
        if not self._drop(state, endpoint, reason):
            return
        if self.config.on_failure == "fail" or not state.alive:
            self.abort()
            left = "no replica left in the pool" if state.alive == [] else "on_failure=fail"
            raise TransportError(
                f"weight update to version {self._version} failed: pool {state.route.name!r} replica {endpoint}: "
                f"{reason} ({left}); no replica committed version {self._version}, all keep their previous one"
            )

    def _prepare(self, state: _PoolState, keep_link: bool = False) -> None:
        """(Re)build the pool's chain: tail first, so every node finds its downstream ready. With ``keep_link``
        (a new version, not a re-route) the data link to the relay stays if it can be reused."""
        while True:
            if not (keep_link and state.push is not None and state.push.reusable(state.alive[0])):
                self._stop_push(state)
            keep_link = False
            state.session, state.acked, state.copies = secrets.token_hex(8), {}, {}
            state.reports, state.deferred, state.claims = {}, [], {}
            failed = self._prepare_chain(state)
            if failed is None:
                return
            self._mark_failed(state, *failed)
            if self._report is not None:
                self._report.reroutes += 1

    def _prepare_chain(self, state: _PoolState) -> tuple[Endpoint, str] | None:
        """Two rounds, each sent to every node before any answer is awaited, so set-up time does not grow with
        the chain: first every node joins the new session, then every node links to its downstream neighbour."""
        chain = state.alive
        for endpoint in chain:
            if endpoint in state.controls and state.controls[endpoint].lost:
                state.controls.pop(endpoint).close()
            if endpoint not in state.controls:
                try:
                    self._open_control(state, endpoint, self.config.timeout_s)
                except TransportError as error:
                    return endpoint, str(error)
        rounds = [
            (
                {
                    e: (
                        Kind.PREPARE,
                        {
                            "session": state.session,
                            "update": self._update,
                            "version": self._version,
                            "upstream": self._sender_hosts if i == 0 else [chain[i - 1].host],
                            "parts": self._parts,
                        },
                    )
                    for i, e in enumerate(chain)
                },
                Kind.READY,
            ),
            (
                {
                    e: (
                        Kind.CONNECT,
                        {"session": state.session, "downstream": str(d), "backend": self.config.backend},
                    )
                    for e, d in zip(chain, chain[1:], strict=False)
                },
                Kind.CONNECTED,
            ),
        ]
        for messages, expected in rounds:
            request_ids = {
                e: state.controls[e].send(kind, **fields) for e, (kind, fields) in messages.items()
            }
            for endpoint, request_id in request_ids.items():
                reply = state.controls[endpoint].reply(request_id)
                if reply.kind == Kind.DOWNSTREAM_FAILED:
                    return Endpoint.parse(reply["peer"]), reply["error"]
                if reply.kind != expected:
                    return endpoint, _error(reply)
                if reply.kind == Kind.READY:
                    state.controls[endpoint].server = reply["server"]
        if state.push is not None:  # kept from the last version: the relay serves it in the new session too
            return None
        relay = chain[0]
        try:
            channel, link = connect_data_link(
                relay.host,
                relay.port,
                self.token,
                state.session,
                self.config.backend,
                self.config.timeout_s,
                self._device,
            )
        except TransportError as error:
            return relay, f"data link to relay failed ({error})"
        state.push = _PoolPush(channel, link, relay, state.route.name, self._events)
        return None

    def _enqueue(self, state: _PoolState, bucket: Bucket) -> None:
        copy = state.copies[bucket.index] = state.copies.get(bucket.index, -1) + 1
        assert state.push is not None
        state.push.work.put(
            (_header(state.session, self._version, bucket, copy), bucket, self.config.chunk_bytes)
        )

    def _check_parts(self, parts: list[PartSummary]) -> list[PartSummary]:
        """The other parts' summaries, in part order; a part that is missing or whose sender failed ends the
        version."""
        by_part = {summary.part: summary for summary in parts}
        if sorted(by_part) != list(range(1, self._parts)):
            self._abandon(f"parts {sorted(by_part)} reported, expected 1 to {self._parts - 1}")
        for part, summary in sorted(by_part.items()):
            if set(summary.failed) - set(self._pools):
                self._abandon(f"part {part} names pools {sorted(summary.failed)} the route does not have")
            indices = [index for index, _, _ in summary.buckets]
            if indices != [bucket_index(part, self._parts, i) for i in range(len(indices))]:
                self._abandon(
                    f"part {part} numbers its buckets {indices[:5]}, not as part {part} of {self._parts}"
                )
        return [by_part[part] for part in range(1, self._parts)]

    def _part_digest(self, summary: PartSummary) -> str:
        return part_digest(self._key, summary.part, [digest for _, digest, _ in summary.buckets])

    def _abandon(self, reason: str) -> None:
        """A failure another part's sender would have to repair: raise (``finish`` aborts everywhere)."""
        raise TransportError(
            f"weight update to version {self._version} failed: {reason}; it was sent in {self._parts} parts, so "
            f"no replica committed version {self._version}, all keep their previous one"
        )

    def _indices(self) -> list[int]:
        return [*self._buckets, *(index for summary in self._remote for index, _, _ in summary.buckets)]

    def _awaited(self, state: _PoolState) -> list[int]:
        """The buckets this pool waits for now (not those another part must send again first)."""
        repair = self._repairs.get(state.route.name)
        if repair is None:
            return self._indices()
        return [i for i in self._indices() if i in self._buckets or not (repair.all or i in repair.resend)]

    def _pool_done(self, state: _PoolState) -> bool:
        alive = set(state.alive)
        return all(alive <= state.acked.get(index, set()) for index in self._awaited(state))

    def _await_buckets(self) -> None:
        last_progress = time.monotonic()
        while not all(self._pool_done(state) for state in self._pools.values()):
            try:
                pool, endpoint, message = self._events.get(timeout=0.5)
            except queue.Empty:
                for state in self._pools.values():  # a copy the relay was waiting for may have gone out whole
                    self._retry_deferred(state)
                if time.monotonic() - last_progress > self.config.timeout_s:
                    self._fail_laggard()
                    last_progress = time.monotonic()
                continue
            state = self._pools[pool]
            if endpoint not in state.alive:
                continue
            kind = message.kind
            if kind == Kind.ACK and message["session"] == state.session:
                last_progress = time.monotonic()
                self._on_ack(state, endpoint, message)
                self._retry_deferred(state)
            elif kind == Kind.FORWARD_FAILED and message["session"] == state.session:
                self._on_forward_failed(state, endpoint, message)
                last_progress = time.monotonic()
            elif (
                kind == Kind.UPSTREAM_LOST
                and message["session"] == state.session
                and endpoint != state.alive[0]
            ):
                # A link between two replicas (the relay's own link from here is this process's to judge).
                self._repair_link(state, endpoint, f"its link from upstream broke: {message['error']}")
                last_progress = time.monotonic()
            elif message.fields.get("false"):
                self._exclude(state, endpoint, message["error"])
                last_progress = time.monotonic()
            elif message.fields.get("lost"):
                self._reroute(state, message["error"], endpoint)
                last_progress = time.monotonic()

    def _on_forward_failed(self, state: _PoolState, endpoint: Endpoint, message: Message) -> None:
        """A replica says its link to its downstream broke: only a replica with that downstream can know it."""
        position = state.alive.index(endpoint)
        downstream = state.alive[position + 1] if position + 1 < len(state.alive) else None
        if downstream is None:
            self._exclude(
                state, endpoint, f"reported its forward to {message['peer']} failed; it has no downstream"
            )
        elif message["peer"] != str(downstream):
            self._exclude(
                state,
                endpoint,
                f"reported its forward to {message['peer']} failed; its downstream is {downstream}",
            )
        else:  # the downstream's own report (UPSTREAM_LOST, acknowledgements) or its stall decides
            logger.warning(
                "pool %s: %s says its forward to %s failed (%s)",
                state.route.name,
                endpoint,
                downstream,
                message["error"],
            )
            state.claims[downstream] = endpoint

    def _exclude(self, state: _PoolState, endpoint: Endpoint, lie: str) -> None:
        """Route out a replica caught reporting falsely, and leave it out of this sender's later versions."""
        self._excluded[endpoint] = lie
        self._reroute(state, f"{lie}; excluded from this sender's versions", endpoint)

    def _expected(self, index: int) -> tuple[str, int] | None:
        """The digest and size of bucket ``index`` as its sender made it (None: no such bucket)."""
        bucket = self._buckets.get(index)
        if bucket is not None:
            return bucket.digest(self._key), bucket.nbytes
        for summary in self._remote:
            for each, digest, nbytes in summary.buckets:
                if each == index:
                    return digest, nbytes
        return None

    def _false_nack(self, state: _PoolState, endpoint: Endpoint, message: Message) -> str:
        """What proves this NACK false ('' when nothing does)."""
        index, copy = message["index"], message["copy"]
        expected = self._expected(index)
        if expected is None:  # a copy above those sent never reaches here (see _judge)
            return f"NACKed copy {copy} of bucket {index}, which was never sent"
        digest, nbytes = expected
        if message["received"] != nbytes:
            return f"NACKed bucket {index} after {message['received']} bytes; a NACK comes after all {nbytes}"
        if message["digest"] == digest:
            return f"NACKed bucket {index} with the digest of its right bytes"
        return ""

    def _reached(self, state: _PoolState, endpoint: Endpoint, index: int, copy: int) -> bool:
        """Has copy ``copy`` of bucket ``index`` reached ``endpoint`` whole? The relay's own-part copies once the
        sender handed them over; any other's once the replica upstream of it reported on that copy."""
        position = state.alive.index(endpoint)
        if position == 0:
            push = state.push
            sent = push.sent.get((state.session, index), -1) if push is not None else -1
            return index not in self._buckets or sent >= copy
        return state.alive[position - 1] in state.reports.get((index, copy), set())

    def _retry_deferred(self, state: _PoolState) -> None:
        deferred, state.deferred = state.deferred, []
        for endpoint, message in deferred:
            if endpoint in state.alive and message["session"] == state.session:
                self._on_ack(state, endpoint, message)

    def _on_ack(self, state: _PoolState, endpoint: Endpoint, message: Message) -> None:
        index, copy = message["index"], message["copy"]
        state.reports.setdefault((index, copy), set()).add(endpoint)
        if message["ok"]:
            state.acked.setdefault(index, set()).add(endpoint)
            claimer = state.claims.get(endpoint)
            if claimer is not None and self._holds_all(state, endpoint):
                self._exclude(
                    state,
                    claimer,
                    f"reported its forward to {endpoint} failed, yet {endpoint} received every bucket through it",
                )
            return
        if message["error"]:  # the replica cannot take the bucket at all (e.g. its stage directory is full)
            self._reroute(state, message["error"], endpoint)
            return
        lie = self._false_nack(state, endpoint, message)
        if lie:
            self._exclude(state, endpoint, lie)
            return
        # Corruption upstream of a node reaches every node after it: re-send once per copy, not per NACK (another
        # part's bucket went out as copy 0).
        latest = state.copies.get(index, -1 if index in self._buckets else 0)
        if copy != latest or endpoint in state.acked.get(index, set()):
            return
        if not self._reached(state, endpoint, index, copy):
            state.deferred.append((endpoint, message))
            return
        if copy >= self.config.max_resends:
            self._blame_corruption(state, index, copy)
            return
        assert self._report is not None
        self._report.resent_buckets += 1
        logger.warning(
            "pool %s: bucket %d failed its checksum at %s; re-sending", state.route.name, index, endpoint
        )
        if index in self._buckets:
            self._enqueue(state, self._buckets[index])
        else:  # its part's sender sends the next copy in the repair round
            state.copies[index] = copy + 1
            self._repairs.setdefault(state.route.name, _Repair()).resend[index] = copy + 1

    def _blame_corruption(self, state: _PoolState, index: int, copy: int) -> None:
        """Bucket ``index`` arrived corrupted ``copy + 1`` times behind the link into the first replica without a
        good copy. Fed by this sender, that replica is routed out; fed by a replica that acknowledged the bucket
        whole, the link is disputed: the upstream may have forwarded other bytes than it holds, or the downstream
        may report bytes it never got, and a digest of what arrived proves neither (both ends hold the key)."""
        suspect = next(e for e in state.alive if e not in state.acked.get(index, set()))
        reason = f"bucket {index} arrived corrupted {copy + 1} times"
        position = state.alive.index(suspect)
        if position == 0:
            self._reroute(state, reason, suspect)
            return
        upstream = state.alive[position - 1]
        self._dispute(
            state, upstream, suspect, f"{reason} at {suspect}, from {upstream}, which holds it whole"
        )

    def _repair_link(self, state: _PoolState, endpoint: Endpoint, reason: str) -> None:
        """A link into ``endpoint`` broke while the replica itself still answers: a repair round (the pool's
        chain again, in a new session, every bucket sent again) keeps it in the version; a replica whose links
        break ``max_resends`` times in one version is re-routed around."""
        repairs = self._link_repairs[endpoint] = self._link_repairs.get(endpoint, 0) + 1
        if repairs > self.config.max_resends:
            upstream = state.alive[state.alive.index(endpoint) - 1]
            self._dispute(state, upstream, endpoint, f"{reason} ({repairs - 1} repair rounds before)")
            return
        logger.warning(
            "pool %s: replica %s: %s; repair round %d", state.route.name, endpoint, reason, repairs
        )
        self._reroute(state, reason)

    def _reroute(self, state: _PoolState, reason: str, *out: Endpoint) -> None:
        """Abort the pool's session, drop the replicas ``out`` (none: a repair round), then prepare a new session
        and send every bucket into it."""
        for control in self._live_controls(state):
            if control.endpoint not in out:
                control.request(Kind.ABORT, session=state.session)
        for endpoint in out:
            self._mark_failed(state, endpoint, reason)
        self._prepare(state)
        assert self._report is not None
        self._report.reroutes += 1
        for bucket in self._buckets.values():
            self._enqueue(state, bucket)
        if self._parts > 1:  # the other parts send every bucket again, into the new session
            self._repairs[state.route.name] = _Repair(all=True)

    def _dispute(self, state: _PoolState, upstream: Endpoint, downstream: Endpoint, reason: str) -> None:
        """The link ``upstream`` -> ``downstream`` failed in a way no evidence the sender can check pins on one
        end. A replica that was in such a dispute with another peer before is the common end: excluded. A pair
        already separated once is routed out both. Otherwise the ends are separated: the downstream goes to the
        front of the chain (fed by this sender, which is trusted), the upstream to the back (it feeds nobody), for
        this version and the later ones."""
        earlier = {end: self._disputes.setdefault(end, set()) for end in (upstream, downstream)}
        repeated = downstream in earlier[upstream]
        common = [end for end, peers in earlier.items() if peers - {upstream, downstream}]
        earlier[upstream].add(downstream)
        earlier[downstream].add(upstream)
        if common:
            lie = f"{reason}; in a dispute with another peer before, so the common end"
            for end in common:
                self._excluded[end] = lie
            self._reroute(state, f"{lie}; excluded from this sender's versions", *common)
        elif repeated:
            self._reroute(
                state,
                f"{reason}; again after its ends were separated, and no evidence says which end",
                upstream,
                downstream,
            )
        else:
            logger.warning(
                "pool %s: %s; nothing shows which end is at fault, so %s now comes first and %s last",
                state.route.name,
                reason,
                downstream,
                upstream,
            )
            state.order = [downstream, *(e for e in state.order if e not in (upstream, downstream)), upstream]
            state.alive = [e for e in state.order if e in state.alive]
            self._reroute(state, reason)

    def _holds_all(self, state: _PoolState, endpoint: Endpoint) -> bool:
        return all(endpoint in state.acked.get(index, set()) for index in self._awaited(state))

    def _fail_laggard(self) -> None:
        for state in self._pools.values():
            laggard = next((e for e in state.alive if not self._holds_all(state, e)), None)
            if laggard is not None:
                self._blame_stall(state, laggard)

    def _blame_stall(self, state: _PoolState, laggard: Endpoint) -> None:
        """Route out whoever stalls the first replica that lacks buckets, by what both ends of the link into it
        show (on the tcp backend the bytes go on those sockets): the laggard when it leaves bytes unread, or is
        fed by this sender, or nccl gives no figures; the upstream when it holds bytes to forward while its socket
        has none queued; an end that gives no status. Any other stall disputes the link: the upstream says it
        forwarded everything, or that its forward failed, or that the laggard does not take its bytes, while the
        laggard says nothing waits for it; the upstream's figures are its own word, so they cannot clear it."""
        silent = f"no progress within {self.config.timeout_s:.0f} s"
        position = state.alive.index(laggard)
        if position == 0 or self.config.backend != "tcp":  # the relay's upstream is this sender
            self._reroute(state, silent, laggard)
            return
        upstream = state.alive[position - 1]
        figures = self._data_paths(state, (upstream, laggard))
        mute = [end for end, shown in figures.items() if shown is None]
        if mute:
            self._reroute(state, f"{silent}, and no status of its data path", *mute)
            return
        sending, receiving = figures[upstream], figures[laggard]
        assert sending is not None and receiving is not None
        if receiving["unread"] > 0:
            self._reroute(
                state, f"{silent}, with {receiving['unread']} bytes from {upstream} unread", laggard
            )
        elif sending["backlog"] > 0 and sending["unsent"] == 0:
            self._reroute(
                state,
                f"stalled its link to {laggard}: it held {sending['backlog']} bytes to forward while its socket "
                f"had none queued and {laggard} none unread, for {self.config.timeout_s:.0f} s",
                upstream,
            )
        elif state.claims.get(laggard) == upstream:
            self._dispute(
                state,
                upstream,
                laggard,
                f"{upstream} said its forward to {laggard} failed, which did not say so",
            )
        else:
            self._dispute(
                state,
                upstream,
                laggard,
                f"no progress into {laggard} within {self.config.timeout_s:.0f} s: {upstream} says it holds "
                f"{sending['backlog']} bytes to forward and {sending['unsent']} in its socket, {laggard} has none "
                f"unread",
            )

    def _data_paths(self, state: _PoolState, ends: tuple[Endpoint, ...]) -> dict[Endpoint, Message | None]:
        """Each replica's STATE (its data path's figures), asked at once; None for one that gives none."""
        asked = {end: state.controls.get(end) for end in ends}
        pending = {end: (control, control.send(Kind.STATUS)) for end, control in asked.items() if control}
        replies = {end: control.reply(request_id) for end, (control, request_id) in pending.items()}
        return {
            end: replies[end] if end in replies and replies[end].kind == Kind.STATE else None for end in ends
        }

    def _verify(self, digest: str, summaries: list[PartSummary]) -> None:
        parts = [[len(s.buckets), s.nbytes, self._part_digest(s)] for s in summaries]
        asked = [
            (
                state,
                control,
                control.send(
                    Kind.END,
                    session=state.session,
                    version=self._version,
                    parts=parts,
                    digest=digest,
                    seal=control.seal(state.session, self._version, digest),
                ),
            )
            for state in self._pools.values()
            for control in self._live_controls(state)
        ]
        for state, control, request_id in asked:
            reply = control.reply(request_id)
            if reply.kind != Kind.VERIFIED:
                self._mark_failed(state, control.endpoint, f"verification failed: {_error(reply)}")


class PartSender:
    """One more sender of a version (part ``part`` of the coordinator's ``assignment``): pushes its own buckets
    to every pool's relay in the coordinator's sessions; the coordinator sees the acknowledgements and verifies.
    ``send_bucket`` for each of its buckets, then ``finish()`` for the :class:`PartSummary` to hand to the
    coordinator, ``repair(plan)`` for each plan the coordinator's ``settle`` returns, and ``release()`` once the
    coordinator has verified (the buckets stay until then). ``begin(assignment)`` starts the next version on the
    same data links where they can be reused (same relay, idle, unbroken); ``close()`` ends them."""

    def __init__(self, assignment: dict[str, Any], part: int, token: bytes | None = None) -> None:
        self.part, self.parts = part, assignment["parts"]
        if not 0 < part < self.parts:
            raise HexError("hex.relay", f"part {part} of {self.parts}", "parts 1 and up send with PartSender")
        self._token = token if token is not None else load_token()
        self._device = current_device()
        self._events: queue.Queue = queue.Queue()
        self._sessions: dict[str, str] = {}
        self._pushes: dict[str, _PoolPush] = {}
        self._failed: dict[str, str] = {}  # this round's
        self._backend = ""
        self.begin(assignment)

    def begin(self, assignment: dict[str, Any]) -> None:
        """Take part in the coordinator's next version (of the same number of parts)."""
        if assignment["parts"] != self.parts:
            raise HexError(
                "hex.relay",
                f"{assignment['parts']} parts, this sender was made for {self.parts}",
                "make a new one",
            )
        if assignment["backend"] != self._backend:
            self.close()
        self.version, self.chunk_bytes = assignment["version"], assignment["chunk_bytes"]
        self._backend, self._timeout_s = assignment["backend"], assignment["timeout_s"]
        self._key = content_key(self._token, assignment["update"])
        self._buckets: dict[int, Bucket] = {}
        self._sent: list[list[Any]] = []  # [index, bucket digest, nbytes] of each bucket
        self._failed = {}
        while not self._events.empty():  # a kept link's last version is over
            self._events.get_nowait()
        for name in set(self._pushes) - set(assignment["pools"]):
            self._pushes.pop(name).close()
        for name, pool in assignment["pools"].items():
            push = self._pushes.get(name)
            if push is not None and push.reusable(Endpoint.parse(pool["relay"])):
                self._sessions[name] = pool["session"]
            else:
                self._link(name, pool)

    def _link(self, name: str, pool: dict[str, str]) -> None:
        """(Re)open the data link to pool ``name``'s relay in its session; a failure goes into the summary."""
        if name in self._pushes:
            self._pushes.pop(name).close()
        relay = Endpoint.parse(pool["relay"])
        try:
            channel, link = connect_data_link(
                relay.host,
                relay.port,
                self._token,
                pool["session"],
                self._backend,
                self._timeout_s,
                self._device,
            )
        except TransportError as error:
            self._failed.setdefault(name, f"cannot open it: {error}")
            return
        self._sessions[name] = pool["session"]
        self._pushes[name] = _PoolPush(channel, link, relay, name, self._events)

    def _push(self, name: str, bucket: Bucket, copy: int) -> None:
        if name in self._pushes:
            header = _header(self._sessions[name], self.version, bucket, copy)
            self._pushes[name].work.put((header, bucket, self.chunk_bytes))

    def send_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        index = bucket_index(self.part, self.parts, len(self._sent))
        pin = self._device.type == "cuda"

        def ready(bucket: Bucket) -> None:  # the bytes go out while they are packed and hashed
            self._buckets[bucket.index] = bucket
            for name in self._pushes:
                self._push(name, bucket, 0)

        bucket = pack(index, named_tensors, self._key, self.chunk_bytes, pin, ready)
        self._sent.append([index, bucket.digest(self._key), bucket.nbytes])

    def finish(self) -> PartSummary:
        """Once every bucket went out: what was sent, and this round's broken links."""
        for push in self._pushes.values():
            push.flush()
        while not self._events.empty():
            name, _, message = self._events.get_nowait()
            self._failed.setdefault(name, _error(message))
        for name in self._failed:  # a broken link sends nothing more; the repair opens a new one
            push = self._pushes.pop(name, None)
            if push is not None:
                push.close()
        failed, self._failed = self._failed, {}
        return PartSummary(self.part, list(self._sent), failed)

    def repair(self, plan: dict[str, Any]) -> PartSummary:
        """Send again what the coordinator's ``settle`` asks of this part: every bucket into a pool's new
        session, or the next copy of buckets that failed their checksum; then :meth:`finish`."""
        for name, pool in plan["pools"].items():
            if pool["all"]:
                self._link(name, pool)
                for bucket in self._buckets.values():
                    self._push(name, bucket, 0)
            for index, copy in pool["resend"]:
                if index in self._buckets:
                    self._push(name, self._buckets[index], copy)
        return self.finish()

    def release(self) -> None:
        """The version is verified: free its buckets; the links stay for the next :meth:`begin`."""
        self._buckets = {}

    def close(self) -> None:
        for push in self._pushes.values():
            push.close()
        self._pushes, self._buckets = {}, {}
