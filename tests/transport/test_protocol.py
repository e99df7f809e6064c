"""The one message schema: each malformed message is refused naming its kind and field (table-driven)."""

from __future__ import annotations

import pytest

from areal_hex_plugin.transport.protocol import Kind, ProtocolError, make, parse

_SESSION, _DIGEST = "ab" * 8, "cd" * 32
_GOOD = {
    "kind": "bucket",
    "session": _SESSION,
    "version": 3,
    "index": 0,
    "copy": 0,
    "nbytes": 8192,
    "chunk": 4096,
    "manifest": [["model.norm.weight", "bfloat16", [4096], 0, 8192]],
}


def test_a_good_bucket_parses_into_a_frozen_message():
    message = parse(dict(_GOOD))
    assert message.kind == Kind.BUCKET and message["nbytes"] == 8192
    with pytest.raises(TypeError):
        message.fields["nbytes"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"kind": "delete_everything"}, "unknown message kind"),
        ({"version": "../../victim"}, "bucket.version: must be an integer"),
        ({"version": 1.0}, "bucket.version: must be an integer"),
        ({"version": -1}, "bucket.version: -1 is outside"),
        ({"nbytes": 6 << 30}, "bucket.nbytes"),
        ({"chunk": 1}, "bucket.chunk"),
        ({"index": 1 << 20}, "bucket.index"),
        ({"session": "../x"}, "bucket.session"),
        ({"manifest": [["w", "complex128", [1024], 0, 16384]]}, "dtype 'complex128' is not allowed"),
        ({"manifest": [["../w", "uint8", [8192], 0, 8192]]}, "bucket.manifest: entry 0"),
        ({"manifest": [["w", "float32", [2048], 4, 8192]]}, "entry 0"),  # a gap before the first tensor
        ({"manifest": [["w", "float32", [100], 0, 8192]]}, "do not hold"),
        ({"extra": 1}, "unknown fields ['extra']"),
    ],
)
def test_malformed_bucket_is_refused_naming_the_field(change, problem):
    with pytest.raises(
        ProtocolError, match=problem.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
    ):
        parse({**_GOOD, **change})


@pytest.mark.parametrize(
    ("kind", "fields", "problem"),
    [
        (
            "end",
            {
                "session": _SESSION,
                "version": 1,
                "digest": _DIGEST,
                "parts": [[10**9, 0, _DIGEST]],
                "id": 1,
                "seal": _DIGEST,
            },
            "end.parts: entry 0: buckets",
        ),
        (
            "end",
            {"session": _SESSION, "version": 1, "digest": _DIGEST, "parts": [], "id": 1, "seal": _DIGEST},
            "end.parts",
        ),
        (
            "end",
            {
                "session": _SESSION,
                "version": 1,
                "digest": _DIGEST,
                "parts": [[1, 0, _DIGEST]] * 33,
                "id": 1,
                "seal": _DIGEST,
            },
            "must list 1 to 32 parts",
        ),
        (
            "end",
            {
                "session": _SESSION,
                "version": 1,
                "digest": _DIGEST,
                "parts": [[1, -1, _DIGEST]],
                "id": 1,
                "seal": _DIGEST,
            },
            "entry 0: nbytes",
        ),
        ("commit", {"session": _SESSION, "version": 2}, "missing fields ['digest', 'id', 'seal']"),
        (
            "prepare",
            {"session": _SESSION, "update": _DIGEST, "version": 1, "upstream": ["a b"], "parts": 1, "id": 1},
            "prepare.upstream: entry 0",
        ),
        (
            "prepare",
            {"session": _SESSION, "update": _DIGEST, "version": 1, "upstream": "", "parts": 1, "id": 1},
            "prepare.upstream: must list",
        ),
        (
            "prepare",
            {"session": _SESSION, "update": _DIGEST, "version": 1, "upstream": [""], "parts": 0, "id": 1},
            "prepare.parts",
        ),
        (
            "prepare",
            {"session": _SESSION, "update": _DIGEST, "version": 1, "upstream": [""], "parts": 1.0, "id": 1},
            "prepare.parts: must be an integer",
        ),
        (
            "connect",
            {"session": _SESSION, "downstream": "x", "backend": "tcp", "id": 1},
            "connect.downstream",
        ),
        ("link", {"backend": "mpi"}, "link.backend"),
        (
            "digests",
            {"session": _SESSION, "version": 3, "index": 0, "copy": 0, "chunks": ["x"]},
            "digests.chunks: entry 0",
        ),
    ],
)
def test_malformed_control_message_is_refused(kind, fields, problem):
    with pytest.raises(ProtocolError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse({"kind": kind, **fields})


def test_messages_to_send_are_checked_against_the_same_table():
    with pytest.raises(ProtocolError, match="status"):
        make(Kind.STATUS)  # a request needs its id
    assert make(Kind.STATUS, id=7).to_wire() == {"kind": "status", "id": 7}
