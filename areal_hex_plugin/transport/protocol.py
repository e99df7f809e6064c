"""The transport's one message schema: every kind, the fields it carries, their types and bounds.

Every frame is checked against this table when it is read (:func:`parse`), before any handler sees it, so a
handler never meets a missing key, a float where an integer belongs, a path-like version, a huge size or an
unknown dtype. A frame that does not fit is a :class:`ProtocolError` naming the kind and the field.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from areal_hex_plugin.specs.config import RELAY_BACKENDS

# 2: Diffie-Hellman handshake, sealed END/COMMIT, upstream_lost; 3: evidence in ACK and STATE, server in READY,
# heartbeats
PROTOCOL_VERSION = 3
# A control channel's heartbeat interval (the trainer's, announced in its hello; both ends beat at it), and how
# many intervals of silence close the channel.
MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS = 50, 60_000
SILENT_HEARTBEATS = 3
MAX_FRAME_BYTES = 8 << 20
MAX_BUCKET_BYTES = 2 << 30  # upstream's weight_chunked_mem_mb default is 1 GiB
MAX_BUCKETS = 1 << 16
MAX_TENSORS_PER_BUCKET = 1 << 14
MAX_VERSION = (1 << 53) - 1
MAX_COPIES = 64
# Senders of one version (its parts), and the hosts a relay may take them from; every part is one lane of data
# links down the chain, and the relay's handshake cap must admit every sender at once.
MAX_PARTS = 32
MAX_HOSTS = 64
MIN_CHUNK_BYTES = 4 << 10
# Chunks per bucket: their digests must fit one frame (a ``digests`` frame), and a receiver's work per bucket is
# bounded by them.
MAX_CHUNKS = 1 << 16
# Tensor names safetensors keeps for itself (a staged file with one would not load).
RESERVED_NAMES = frozenset({"__metadata__"})
# safetensors dtype names of the tensors a bucket may carry (torch name -> safetensors name).
DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2}


class ProtocolError(RuntimeError):
    """A frame that does not fit the schema (or fails its authentication tag)."""


class Kind(enum.StrEnum):
    HELLO = "hello"
    HEARTBEAT = "heartbeat"  # either way on a control channel, every heartbeat interval
    # sender -> node, on the control connection (each carries an ``id`` the answer echoes)
    PREPARE = "prepare"
    CONNECT = "connect"
    END = "end"
    COMMIT = "commit"
    ABORT = "abort"
    STATUS = "status"
    # node -> sender
    READY = "ready"
    CONNECTED = "connected"
    DOWNSTREAM_FAILED = "downstream_failed"
    VERIFIED = "verified"
    COMMITTED = "committed"
    ABORTED = "aborted"
    STATE = "state"
    ERROR = "error"
    ACK = "ack"
    FORWARD_FAILED = "forward_failed"
    UPSTREAM_LOST = "upstream_lost"  # a data link from upstream broke before the session's end
    # upstream -> downstream, on a data connection
    LINK = "link"
    BUCKET = "bucket"
    DIGESTS = "digests"  # a bucket's chunk digests, right after its bytes
    # the rendezvous of a gloo/NCCL link, served over the authenticated data connection
    STORE_SET = "store_set"
    STORE_GET = "store_get"
    STORE_COMPARE_SET = "store_compare_set"
    STORE_ADD = "store_add"
    STORE_CHECK = "store_check"
    STORE_VALUE = "store_value"
    STORE_DONE = "store_done"


@dataclass(frozen=True)
class Field:
    check: Callable[[Any], str | None]  # None when fine, else what is wrong

    def __call__(self, value: Any) -> str | None:
        return self.check(value)


def integer(lo: int, hi: int) -> Field:
    def check(value: Any) -> str | None:
        if type(value) is not int:
            return f"must be an integer, got {type(value).__name__}"
        return None if lo <= value <= hi else f"{value} is outside [{lo}, {hi}]"

    return Field(check)


def text(max_len: int, pattern: str | None = None) -> Field:
    regex = re.compile(pattern) if pattern else None

    def check(value: Any) -> str | None:
        if not isinstance(value, str):
            return f"must be a string, got {type(value).__name__}"
        if len(value) > max_len:
            return f"longer than {max_len} characters"
        return None if regex is None or regex.fullmatch(value) else f"{value[:40]!r} does not match {pattern}"

    return Field(check)


def choice(*options: Any) -> Field:
    return Field(lambda value: None if value in options else f"{value!r} is not one of {list(options)}")


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _digests(value: Any) -> str | None:
    if not isinstance(value, list) or len(value) > MAX_CHUNKS:
        return "must be a list of chunk digests"
    return next((f"entry {i} is not a digest" for i, d in enumerate(value) if _DIGEST.check(d)), None)


def _store_keys(value: Any) -> str | None:
    if not isinstance(value, list) or not 0 < len(value) <= 16:
        return "must list 1 to 16 keys"
    return next((f"key {i}: {problem}" for i, key in enumerate(value) if (problem := text(256)(key))), None)


def _manifest(value: Any) -> str | None:
    """Entries [name, dtype, shape, offset, nbytes] that tile the bucket without gaps, each aligned."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TENSORS_PER_BUCKET:
        return f"must list 1 to {MAX_TENSORS_PER_BUCKET} tensors"
    end = 0
    for i, entry in enumerate(value):
        if not (isinstance(entry, list) and len(entry) == 5):
            return f"entry {i} is not [name, dtype, shape, offset, nbytes]"
        name, dtype, shape, offset, nbytes = entry
        problem = (
            _NAME.check(name)
            or (f"name {name!r} is reserved by safetensors" if name in RESERVED_NAMES else None)
            or (None if dtype in DTYPES else f"dtype {dtype!r} is not allowed")
            or _shape(shape)
            or integer(end, end)(offset)
            or integer(0, MAX_BUCKET_BYTES)(nbytes)
        )
        if problem is None:
            size = ITEMSIZE.get(dtype, 1)
            count = 1
            for dim in shape:
                count *= dim
            if count * size != nbytes:
                problem = f"{nbytes} bytes do not hold {dtype}{shape}"
            elif offset % size:
                problem = f"offset {offset} is not aligned for {dtype}"
        if problem is not None:
            return f"entry {i}: {problem}"
        end = offset + nbytes
    return None


def _hosts(value: Any) -> str | None:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_HOSTS:
        return f"must list 1 to {MAX_HOSTS} hosts"
    return next((f"entry {i}: {problem}" for i, h in enumerate(value) if (problem := _HOST.check(h))), None)


def _parts(value: Any) -> str | None:
    """Entries [buckets, nbytes, digest], one per part of the version."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_PARTS:
        return f"must list 1 to {MAX_PARTS} parts"
    for i, entry in enumerate(value):
        if not (isinstance(entry, list) and len(entry) == 3):
            return f"entry {i} is not [buckets, nbytes, digest]"
        buckets, nbytes, digest = entry
        problem = (
            (None if (p := integer(0, MAX_BUCKETS)(buckets)) is None else f"buckets {p}")
            or (None if (p := integer(0, MAX_BUCKETS * MAX_BUCKET_BYTES)(nbytes)) is None else f"nbytes {p}")
            or _DIGEST.check(digest)
        )
        if problem is not None:
            return f"entry {i}: {problem}"
    return None


def _shape(value: Any) -> str | None:
    if not isinstance(value, list) or len(value) > 8:
        return "shape must be a list of at most 8 sizes"
    size = integer(0, MAX_BUCKET_BYTES)
    return next((problem for d in value if (problem := size(d))), None)


_DIGEST = text(64, r"[0-9a-f]{64}")
_NAME = text(512, r"[A-Za-z0-9_.\-]+")
_SESSION = text(32, r"[0-9a-f]{16,32}")
_ID = integer(0, MAX_VERSION)
_VERSION = integer(0, MAX_VERSION)
_ERROR = text(2000)
_HOST = text(255, r"[A-Za-z0-9_.:\-]*")
_QUEUED = integer(0, 1 << 62)  # bytes in a node's queues
_ENDPOINT = text(300, r"\[?[A-Za-z0-9_.:\-]+\]?:[0-9]{1,5}")

# The fields of each kind (every one required, no others allowed); ``id`` is added to control traffic.
FIELDS: dict[Kind, dict[str, Field]] = {
    Kind.HELLO: {
        "role": choice("control", "data"),
        "proto": choice(PROTOCOL_VERSION),
        "session": text(32),
        # The control channel's heartbeat interval (0 on a data link, which has none).
        "heartbeat_ms": integer(0, MAX_HEARTBEAT_MS),
    },
    Kind.HEARTBEAT: {},
    Kind.PREPARE: {
        "session": _SESSION,
        "update": _DIGEST,
        "version": _VERSION,
        # Who may open data links for the session: the upstream neighbour, or at a relay every sender ("" for the
        # control peer itself).
        "upstream": Field(_hosts),
        "parts": integer(1, MAX_PARTS),
    },
    Kind.CONNECT: {"session": _SESSION, "downstream": _ENDPOINT, "backend": choice(*RELAY_BACKENDS)},
    # ``seal``: the version digest's MAC with the key of the trainer's control channel to this replica
    # (buckets.seal), which no relay can compute.
    Kind.END: {
        "session": _SESSION,
        "version": _VERSION,
        "parts": Field(_parts),
        "digest": _DIGEST,
        "seal": _DIGEST,
    },
    Kind.COMMIT: {"session": _SESSION, "version": _VERSION, "digest": _DIGEST, "seal": _DIGEST},
    Kind.ABORT: {"session": text(32)},
    Kind.STATUS: {},
    # ``server``: what to check when this replica's commit is in doubt (its inference server; '' if none named).
    Kind.READY: {"version": integer(-1, MAX_VERSION), "server": text(300)},
    Kind.CONNECTED: {},
    Kind.DOWNSTREAM_FAILED: {"peer": _ENDPOINT, "error": _ERROR},
    Kind.VERIFIED: {"digest": _DIGEST},
    Kind.COMMITTED: {"version": _VERSION},
    Kind.ABORTED: {},
    # ``loading``: the version the replica is loading now (-1: none); then the current session's data path, both
    # ends of each link: bytes arrived from upstream not yet read (``unread``), bytes held to forward downstream not
    # yet handed to the socket (``backlog``) and bytes in that socket not yet taken by the downstream (``unsent``).
    Kind.STATE: {
        "version": integer(-1, MAX_VERSION),
        "digest": text(64),
        "loading": integer(-1, MAX_VERSION),
        "unread": _QUEUED,
        "backlog": _QUEUED,
        "unsent": _QUEUED,
    },
    Kind.ERROR: {"error": _ERROR},
    Kind.ACK: {
        "session": _SESSION,
        "index": integer(0, MAX_BUCKETS - 1),
        "copy": integer(0, MAX_COPIES),
        "ok": Field(_flag),
        "error": _ERROR,
        # The evidence of a NACK: how many bytes of the copy arrived, and the keyed digest of what arrived
        # (buckets.bucket_digest over the chunk digests the replica computed; '' for a refused bucket).
        "received": integer(0, MAX_BUCKET_BYTES),
        "digest": text(64, r"([0-9a-f]{64})?"),
    },
    Kind.FORWARD_FAILED: {"session": _SESSION, "peer": _ENDPOINT, "error": _ERROR},
    Kind.UPSTREAM_LOST: {"session": _SESSION, "error": _ERROR},
    Kind.LINK: {"backend": choice(*RELAY_BACKENDS)},
    Kind.BUCKET: {
        "session": _SESSION,
        "version": _VERSION,
        "index": integer(0, MAX_BUCKETS - 1),
        "copy": integer(0, MAX_COPIES),
        "nbytes": integer(1, MAX_BUCKET_BYTES),
        "chunk": integer(MIN_CHUNK_BYTES, MAX_BUCKET_BYTES),
        "manifest": Field(_manifest),
    },
    Kind.DIGESTS: {
        "session": _SESSION,
        "version": _VERSION,
        "index": integer(0, MAX_BUCKETS - 1),
        "copy": integer(0, MAX_COPIES),
        "chunks": Field(_digests),
    },
    Kind.STORE_SET: {"key": text(256), "value": text(1 << 17, r"[0-9a-f]*")},
    Kind.STORE_GET: {"key": text(256)},
    Kind.STORE_COMPARE_SET: {
        "key": text(256),
        "expected": text(1 << 17, r"[0-9a-f]*"),
        "value": text(1 << 17, r"[0-9a-f]*"),
    },
    Kind.STORE_ADD: {"key": text(256), "amount": integer(-(1 << 31), 1 << 31)},
    Kind.STORE_CHECK: {"keys": Field(_store_keys)},
    Kind.STORE_VALUE: {"value": text(1 << 17, r"[0-9a-f]*")},
    Kind.STORE_DONE: {},
}
_CONTROL = {
    Kind.PREPARE,
    Kind.CONNECT,
    Kind.END,
    Kind.COMMIT,
    Kind.ABORT,
    Kind.STATUS,
    Kind.READY,
    Kind.CONNECTED,
    Kind.DOWNSTREAM_FAILED,
    Kind.VERIFIED,
    Kind.COMMITTED,
    Kind.ABORTED,
    Kind.STATE,
    Kind.ERROR,
}


@dataclass(frozen=True)
class Message:
    kind: Kind
    fields: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind.value, **self.fields}


def chunk_count(bucket: Message) -> int:
    """How many chunks a ``bucket`` header's bytes come in (a header with more than MAX_CHUNKS is refused)."""
    count = -(-bucket["nbytes"] // bucket["chunk"])
    if count > MAX_CHUNKS:
        raise ProtocolError(
            f"bucket {bucket['index']}: {bucket['nbytes']} bytes in chunks of {bucket['chunk']} are more than "
            f"{MAX_CHUNKS} chunks"
        )
    return count


def make(kind: Kind, **fields: Any) -> Message:
    """A message to send, checked against the same table as what is received."""
    return _checked(kind, fields)


def digests_after(bucket: Message, chunks: list[str]) -> Message:
    """The ``digests`` frame that follows ``bucket``'s bytes on a data link (same session, version, index, copy)."""
    return make(
        Kind.DIGESTS,
        chunks=chunks,
        **{name: bucket[name] for name in ("session", "version", "index", "copy")},
    )


def parse(body: Any, expect: set[Kind] | None = None) -> Message:
    if not isinstance(body, dict) or "kind" not in body:
        raise ProtocolError("frame is not a message object with a kind")
    try:
        kind = Kind(body["kind"])
    except ValueError:
        raise ProtocolError(f"unknown message kind {str(body['kind'])[:40]!r}") from None
    if expect is not None and kind not in expect:
        raise ProtocolError(f"{kind.value}: not expected here (expected {sorted(k.value for k in expect)})")
    return _checked(kind, {k: v for k, v in body.items() if k != "kind"})


def _checked(kind: Kind, fields: dict[str, Any]) -> Message:
    table = dict(FIELDS[kind])
    if kind in _CONTROL:
        table["id"] = _ID
    if set(fields) != set(table):
        missing, extra = sorted(set(table) - set(fields)), sorted(set(fields) - set(table))
        raise ProtocolError(f"{kind.value}: missing fields {missing}, unknown fields {extra}")
    for name, spec in table.items():
        problem = spec.check(fields[name])
        if problem is not None:
            raise ProtocolError(f"{kind.value}.{name}: {problem}")
    return Message(kind, MappingProxyType(dict(fields)))
