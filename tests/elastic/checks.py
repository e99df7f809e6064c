"""Checks shared by the elastic e2e tests on the stand-in servers' logs."""

from __future__ import annotations


def committed_first_loads(new: list[dict], others: list[list[dict]]) -> list[tuple[int, dict]]:
    """A server started mid-run: its loads of committed versions (index in its log, record), after asserting that
    the first came before its first request, that each carries the digest the ``others`` loaded for that version,
    and that it generated with those versions only."""
    first_request = next(i for i, r in enumerate(new) if r["event"] == "request")
    loads = [(i, r) for i, r in enumerate(new) if r["event"] == "load" and r["version"] != "default"]
    assert loads and loads[0][0] < first_request, new[: first_request + 1]
    digests = {
        r["version"]: r["digest"]
        for records in others
        for r in records
        if r["event"] == "load" and r["version"] != "default"
    }
    assert all(digests[r["version"]] == r["digest"] for _, r in loads), (loads, digests)
    assert {r["version"] for r in new if r["event"] == "generate"} <= {r["version"] for _, r in loads}
    return loads
