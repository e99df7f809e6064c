"""No listener without a deadline and an authentication step (issue 37): every TCP port a node or a trainer
process listens on, flooded with unauthenticated connections from the test (a host on no allow-list would do the
same), costs a bounded number of descriptors and no process, and the kept link still carries the next version.
Real replica processes, a real trainer process, real kept links over loopback."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import time

import psutil
import pytest

from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from tests.transport.harness import TOKEN, ReplicaFleet
from tests.transport.trainers import TrainerProcess, state_of

pytestmark = pytest.mark.integration

_FLOOD_PER_PORT = 60
# Descriptors a flooded process may hold beyond its count before the flood: the node's handshake slots (32 and
# 4 for the trainer's hosts), each one connection, and some slack.
_FD_GROWTH_BOUND = 48


def _listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` holds a listening socket on (its own and any library's)."""
    return sorted(
        {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    )


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _flood(ports: list[int]) -> list[socket.socket]:
    """``_FLOOD_PER_PORT`` connections to each port that never say a word (non-blocking connects: a full accept
    queue does not slow the flood down)."""
    flood = []
    for port in ports:
        for _ in range(_FLOOD_PER_PORT):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            flood.append(sock)
    return flood


def _settled_fds(pid: int, process: mp.Process, within_s: float = 3.0) -> int:
    """The process's descriptor count once it stops changing for 0.5 s (or after ``within_s``); returns at once
    when the process died."""
    deadline, last, since = time.monotonic() + within_s, -1, time.monotonic()
    while time.monotonic() < deadline and process.is_alive():
        count = _open_fds(pid)
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            break
        time.sleep(0.05)
    return last


def _assert_survives_flood(pid: int, process: mp.Process) -> None:
    ports = _listening_ports(pid)
    before = _open_fds(pid)
    flood = _flood(ports)
    try:
        during = _settled_fds(pid, process)
        assert process.is_alive(), f"exit code {process.exitcode} after flooding ports {ports}"
        assert during - before <= _FD_GROWTH_BOUND, f"{during - before} descriptors held for ports {ports}"
    finally:
        for sock in flood:
            sock.close()


def test_a_node_with_a_kept_gloo_link_survives_a_flood_of_every_port_it_listens_on(tmp_path):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1], limits={resource.RLIMIT_NOFILE: 64})
        sender = RelaySender(
            Route([PoolRoute("h20", [replica.endpoint], 1.5, 5.0)]),
            SenderConfig("gloo", timeout_s=10.0),
            token=TOKEN,
        )
        try:
            assert sender.send_version(1, [list(state_of(1).items())]).committed == [str(replica.endpoint)]
            _assert_survives_flood(replica.process.pid, replica.process)
            assert sender.send_version(2, [list(state_of(2).items())]).committed == [str(replica.endpoint)]
        finally:
            sender.close()
        assert replica.committed()["version"] == 2


def test_a_trainer_with_a_kept_gloo_link_survives_a_flood_of_every_port_it_listens_on(tmp_path):
    with ReplicaFleet(tmp_path, timeout_s=5.0) as fleet:
        (replica,) = fleet.start([1])
        with TrainerProcess([replica.endpoint], fd_headroom=48, backend="gloo", timeout_s=10.0) as trainer:
            assert trainer.send(1) == [str(replica.endpoint)]
            _assert_survives_flood(trainer.pid, trainer.process)
            assert trainer.send(2) == [str(replica.endpoint)]
        assert replica.committed()["version"] == 2
