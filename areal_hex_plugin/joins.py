"""``hex_join.jsonl`` beside a run's ``hex_plan.json``: machines asked to join the running plan.

``areal-hex join`` appends one request a line (``{"pool", "host", "requested_at"}``; a request's number is its
line, from 0) after checking it against the plan the run keeps beside its config; the run's elastic watcher
(``areal/elastic/``) reads the new lines, starts the machine's rollout servers and records the outcome in the
plan's ``changes`` with ``join request N`` in its reason (``gained`` once a server serves, ``lost`` when the join
failed). Pure: no areal import.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan

JOIN_FILE = "hex_join.jsonl"
# A host name or address as schedulers name machines (no spaces, no '/': server names are host/rank).
HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")


@dataclass(frozen=True)
class JoinRequest:
    index: int  # its line in the file, from 0
    pool: str
    host: str


def join_file(plan_path: str | os.PathLike) -> Path:
    """The join requests of the run whose plan is ``plan_path``."""
    return Path(plan_path).with_name(JOIN_FILE)


def tag(index: int) -> str:
    """The words a change's reason carries for join request ``index``."""
    return f"join request {index}"


def read_requests(path: str | os.PathLike, start: int = 0) -> tuple[list[JoinRequest], list[str]]:
    """The complete lines of ``path`` from line ``start`` on: the requests, and a problem for each malformed line
    (a line being written, without its newline yet, is left for the next read)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return [], []
    lines = text.split("\n")[:-1]  # the last piece has no newline: unfinished, or ""
    requests, problems = [], []
    for index, line in enumerate(lines[start:], start):
        try:
            record = json.loads(line)
            pool, host = record["pool"], record["host"]
            if not isinstance(pool, str) or not isinstance(host, str) or not HOST_RE.match(host):
                raise ValueError("pool and host must be names")
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"{path} line {index + 1} is not a join request ({error}); it is skipped")
            continue
        requests.append(JoinRequest(index, pool, host))
    return requests, problems


def host_in_use(plan: HexPlan, requests: list[JoinRequest], host: str) -> str | None:
    """Why ``host`` cannot join the run of ``plan`` (its servers' last recorded change, its plan role, or a join
    request the run has not answered), None when it can (a new host, an idle one, or one whose servers were lost)."""
    answered = {int(n) for c in plan.changes for n in re.findall(r"\bjoin request (\d+)\b", c.reason)}
    pending = [r.index for r in requests if r.host == host and r.index not in answered]
    if pending:
        return f"{tag(pending[0])} for it is not answered yet in the plan's changes"
    machine = next((m for m in plan.machines if m.host == host), None)
    if machine is not None and machine.role not in ("rollout", "idle"):
        return f"it is a {machine.role} machine of the plan"
    named = [
        c
        for c in plan.changes
        if c.kind in ("lost", "gained") and any(h.split("/")[0] == host for h in c.hosts)
    ]
    if named:
        last = named[-1]
        return None if last.kind == "lost" else f"it serves rollouts since step {last.step} ({last.reason})"
    if machine is not None and machine.role == "rollout":
        return "it serves rollouts in the plan"
    return None


def check_join(plan: HexPlan, requests: list[JoinRequest], pool: str, host: str) -> None:
    """HexError unless ``host`` of ``pool`` may join the run of ``plan``."""
    pools = sorted({m.pool for m in plan.machines})
    if pool not in pools:
        raise HexError("--pool", f"{pool!r} is not a pool of the plan", f"use one of {', '.join(pools)}")
    if not HOST_RE.match(host):
        raise HexError(
            "--host", f"{host!r} is not a host name", "give the machine's name or address, e.g. --host h20-9"
        )
    machine = next((m for m in plan.machines if m.host == host), None)
    if machine is not None and machine.pool != pool:
        raise HexError(
            "--host", f"{host!r} is a machine of pool {machine.pool!r}", f"use --pool {machine.pool}"
        )
    why = host_in_use(plan, requests, host)
    if why:
        raise HexError(
            "--host",
            f"{host!r} is in use: {why}",
            "name another machine, or wait until the run records it lost (the plan's changes)",
        )


def append_request(path: str | os.PathLike, pool: str, host: str) -> int:
    """Append a request (one write of one whole line, so a reader never sees half of it); its number."""
    path = Path(path)
    requests, problems = read_requests(path)
    index = len(requests) + len(problems)
    line = json.dumps({"pool": pool, "host": host, "requested_at": round(time.time(), 3)}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return index
