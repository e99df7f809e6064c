"""Issue 37, crash-safe spill: a loaded version that cannot move to the rollback dir (its stage is out of inodes, e.g.
another replica on the same /dev/shm) stays where the server loaded it, whole, and the next commit goes on."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from tests.transport.harness import TOKEN, transport_records

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((64, 64), float(version)) for i in range(2)}


@contextlib.contextmanager
def _small_tmpfs(path: Path):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=64", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _use_every_inode(directory: Path) -> list[Path]:
    """Another tenant's files, one per inode, until the filesystem has none left."""
    directory.mkdir()
    taken = []
    with contextlib.suppress(OSError):
        while True:
            (directory / str(len(taken))).touch()
            taken.append(directory / str(len(taken)))
    return taken


def _wait_for(condition, what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def records(monkeypatch):
    """The stage's and node's warnings (a list of records each), and every exception that ends a thread."""
    seen: dict[str, list] = {"log": [], "died": []}
    for name in ("HexTransportNode", "HexStage"):
        seen["log"].append(transport_records(name, monkeypatch, logging.WARNING))
    monkeypatch.setattr(threading, "excepthook", lambda args: seen["died"].append(args.exc_value))
    return seen


def _holds(directory: Path, version: int) -> bool:
    loaded = {}
    for path in sorted(directory.glob("*.safetensors")):
        loaded.update(load_file(path))
    expected = _weights(version)
    return loaded.keys() == expected.keys() and all(torch.equal(loaded[n], t) for n, t in expected.items())


def test_a_spill_without_inodes_keeps_the_loaded_version_and_the_next_commit_goes_on(tmp_path, records):
    with _small_tmpfs(tmp_path / "shm") as shm:
        rollback = tmp_path / "disk"
        rollback.mkdir(mode=0o700)
        config = ReceiverConfig(timeout_s=5.0, stage_dir=str(shm), rollback_dir=str(rollback))
        node = ReceiverNode(MemorySink(), config, token=TOKEN)
        endpoint = node.start()
        route = Route([PoolRoute("p", [endpoint], 1.5, 5.0)])
        sender = RelaySender(route, SenderConfig(timeout_s=5.0), token=TOKEN)
        try:
            sender.begin(1)
            sender.send_bucket(list(_weights(1).items()))
            sender.finish(commit=False)
            other_tenant = _use_every_inode(shm / "other")
            sender.commit()
            assert sender.last_report.committed == [str(endpoint)]
            _wait_for(
                lambda: any(
                    "cannot move version v1" in r.getMessage() for log in records["log"] for r in log
                ),
                "the spill's outcome",
            )

            loaded = node.stage_root / "v1"  # the path the server loaded, and would roll back to
            assert loaded.is_dir() and not loaded.is_symlink() and _holds(loaded, 1)
            assert sorted(p.name for p in node.stage_root.iterdir()) == [".owner", "spare", "v1"]
            assert [p.name for p in node.rollback_root.iterdir()] == [".owner"]  # no half-kept copy on disk

            for path in other_tenant:
                path.unlink()
            report = sender.send_version(2, [list(_weights(2).items())])
            assert report.committed == [str(endpoint)] and node.version == 2
            listing = [".owner", "spare", "v2"]
            # v2 is a directory (staged) before it becomes a link (spilled) under the same listing
            _wait_for(
                lambda: (
                    sorted(p.name for p in node.stage_root.iterdir()) == listing
                    and (node.stage_root / "v2").is_symlink()
                ),
                "version 2 spilled",
            )
            assert _holds(node.stage_root / "v2", 2)  # read through the link, from the rollback dir
            assert records["died"] == []
        finally:
            sender.close()
            node.stop()
