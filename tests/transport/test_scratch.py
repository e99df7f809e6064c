"""Stage and rollback dirs of a killed receiver are reclaimed by the next one; a live one's never are."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.scratch import OwnedDir, reclaim_orphans
from areal_hex_plugin.transport.sinks import MemorySink
from tests.transport.harness import TOKEN

_CTX = mp.get_context("spawn")


def _serve(rollback_dir: str, ready) -> None:
    node = ReceiverNode(MemorySink(), ReceiverConfig(rollback_dir=rollback_dir), token=TOKEN)
    ready.put((str(node.stage_root), str(node.rollback_root)))
    signal.pause()


def _start(rollback_dir: Path):
    ready = _CTX.Queue()
    process = _CTX.Process(target=_serve, args=(str(rollback_dir), ready), daemon=True)
    process.start()
    return process, [Path(p) for p in ready.get(timeout=120)]


def test_a_killed_receivers_dirs_are_removed_by_the_next_and_a_live_ones_kept(tmp_path):
    private = tmp_path / f"areal-hex-uid{os.geteuid()}"  # this user's own parent of the rollback dirs
    killed, killed_dirs = _start(tmp_path)
    alive, alive_dirs = _start(tmp_path)
    try:
        for path in (*killed_dirs, *alive_dirs):
            (path / "bucket-00000-00.safetensors").write_bytes(b"x" * 1024)
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(timeout=30)
        assert all(p.is_dir() for p in killed_dirs)  # nothing ran in the killed process

        node = ReceiverNode(MemorySink(), ReceiverConfig(rollback_dir=str(tmp_path)), token=TOKEN)
        try:
            assert not any(p.exists() for p in killed_dirs)
            assert all(p.is_dir() for p in alive_dirs)
            assert {node.stage_root.parent, node.rollback_root.parent} == {killed_dirs[0].parent, private}
        finally:
            node.stop()
        assert not node.stage_root.exists() and not node.rollback_root.exists()
    finally:
        alive.kill()
        alive.join(timeout=30)
    assert set(reclaim_orphans(private)) == {alive_dirs[1]}
    assert alive_dirs[0] in reclaim_orphans(alive_dirs[0].parent)


def test_a_dir_of_this_process_is_not_an_orphan(tmp_path):
    mine = OwnedDir(tmp_path, "hex.relay.stage_dir")
    assert reclaim_orphans(mine.path.parent) == [] and mine.path.is_dir()
    mine.remove()
    assert not mine.path.exists()
