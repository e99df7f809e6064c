"""Issue 37, stage directories nobody else can own: a receiver stages only under a private per-user parent it
made (or verified) itself, never follows a link it did not make, reads no owner file that could block it, and
loads into the server exactly the files it verified. Tests run as root; another local user is uid 65534."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.sinks import MemorySink
from tests.transport.harness import TOKEN

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays another local user (chown, setuid): root")

_REPO = Path(__file__).resolve().parents[2]
_NOBODY = 65534
_WEIGHTS = {"model.norm.weight": torch.arange(256, dtype=torch.float32)}


def _sticky(tmp_path: Path) -> Path:
    """A shared directory like /dev/shm or /var/tmp: root's, world-writable, sticky."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def _made_by_nobody(path: Path, mode: int = 0o777) -> Path:
    """What another local user creates first (owner uid 65534, anyone may write)."""
    path.mkdir()
    os.chown(path, _NOBODY, _NOBODY)
    path.chmod(mode)
    return path


def _private_parent(shared: Path) -> Path:
    return shared / f"areal-hex-uid{os.geteuid()}"


def _send(endpoint, version: int, weights: dict[str, torch.Tensor], commit: bool = True):
    """A sender that sent ``weights`` as one bucket and finished (verified, committed unless told not to)."""
    sender = RelaySender(
        Route([PoolRoute("p", [endpoint], 1.5, 5.0)]), SenderConfig(timeout_s=5.0), token=TOKEN
    )
    sender.begin(version)
    sender.send_bucket(list(weights.items()))
    return sender, sender.finish(commit=commit)


class PathSink:
    """Loads a committed version the way SGLang does: every ``*.safetensors`` file of its directory, by path."""

    def __init__(self) -> None:
        self.version, self.tensors = -1, {}

    def load(self, version: int, staged) -> None:
        tensors = {}
        for path in sorted(Path(staged.directory).glob("*.safetensors")):
            tensors.update(load_file(path))
        self.version, self.tensors = version, tensors


# -- foreign stage parent --------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["stage_dir", "rollback_dir"])
def test_a_parent_another_user_made_first_is_refused(tmp_path, setting):
    """The adapter's old fixed name (``areal-hex`` in the shared dir), made first by uid 65534 with mode 0777:
    whoever owns a parent can rename what a root node stages there and put their own files in its place."""
    foreign = _made_by_nobody(_sticky(tmp_path) / "areal-hex")
    config = ReceiverConfig(**{"stage_dir": str(tmp_path), setting: str(foreign)})
    with pytest.raises(HexError) as refused:
        ReceiverNode(MemorySink(), config, token=TOKEN)
    assert refused.value.field == f"hex.relay.{setting}"
    assert str(foreign) in refused.value.problem and "uid 65534" in refused.value.problem
    assert list(foreign.iterdir()) == []  # nothing staged in it


def test_a_per_user_parent_another_user_made_first_is_refused(tmp_path):
    shared = _sticky(tmp_path)
    foreign = _made_by_nobody(_private_parent(shared))
    with pytest.raises(HexError) as refused:
        ReceiverNode(MemorySink(), ReceiverConfig(stage_dir=str(shared)), token=TOKEN)
    assert str(foreign) in refused.value.problem and str(foreign) in refused.value.fix
    assert list(foreign.iterdir()) == []


@pytest.mark.parametrize("plant", ["link", "group_writable"])
def test_a_per_user_parent_that_is_a_link_or_not_private_is_refused(tmp_path, plant):
    shared = _sticky(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    if plant == "link":
        _private_parent(shared).symlink_to(mine, target_is_directory=True)
    else:
        _private_parent(shared).mkdir()
        _private_parent(shared).chmod(0o770)
    with pytest.raises(HexError, match="areal-hex-uid"):
        ReceiverNode(MemorySink(), ReceiverConfig(stage_dir=str(shared)), token=TOKEN)
    assert list(mine.iterdir()) == []


def test_a_node_stages_in_a_private_per_user_parent_of_the_shared_dir(tmp_path):
    shared = _sticky(tmp_path)
    node = ReceiverNode(MemorySink(), ReceiverConfig(stage_dir=str(shared)), token=TOKEN)
    try:
        parent = os.lstat(_private_parent(shared))
        assert node.stage_root.parent == _private_parent(shared)
        assert stat.S_ISDIR(parent.st_mode) and parent.st_uid == os.geteuid()
        assert stat.S_IMODE(parent.st_mode) == 0o700
        assert [p.name for p in shared.iterdir()] == [_private_parent(shared).name]  # no other fixed name
    finally:
        node.stop()


# -- planted link ----------------------------------------------------------------------------------------------


def test_a_planted_version_link_does_not_delete_its_target(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    node = ReceiverNode(MemorySink(), ReceiverConfig(stage_dir=str(_sticky(tmp_path))), token=TOKEN)
    try:
        (node.stage_root / "v2").symlink_to(victim, target_is_directory=True)
        endpoint = node.start()
        sender, report = _send(endpoint, 2, _WEIGHTS)
        sender.close()
        assert report.committed == [str(endpoint)] and node.version == 2
        assert (victim / "precious").read_text() == "keep me"
        assert not (node.stage_root / "v2").is_symlink()
    finally:
        node.stop()
    assert (victim / "precious").read_text() == "keep me"


# -- the server loads what the node verified ---------------------------------------------------------------


def test_a_staged_file_swapped_after_verification_is_not_loaded(tmp_path):
    """Between the version's end (verified) and its commit, the bucket file the server would load by path is
    replaced with other tensors: the node refuses the commit instead of loading them under the trainer's digest."""
    node = ReceiverNode(PathSink(), ReceiverConfig(stage_dir=str(_sticky(tmp_path))), token=TOKEN)
    try:
        endpoint = node.start()
        sender, _ = _send(endpoint, 1, _WEIGHTS, commit=False)
        (bucket,) = (node.stage_root / "v1").glob("*.safetensors")
        swapped = bucket.with_name("swap.tmp")
        save_file({"model.norm.weight": torch.full((256,), 7.0)}, swapped)
        swapped.replace(bucket)
        sender.commit()
        report = sender.last_report
        sender.close()
        assert report.committed == [] and node.sink.version == -1 and node.version != 1
        assert bucket.name in report.failed[str(endpoint)]
    finally:
        node.stop()


def test_unswapped_files_load_and_another_user_cannot_swap_them(tmp_path):
    node = ReceiverNode(PathSink(), ReceiverConfig(stage_dir=str(_sticky(tmp_path))), token=TOKEN)
    try:
        endpoint = node.start()
        sender, _ = _send(endpoint, 1, _WEIGHTS, commit=False)
        (bucket,) = (node.stage_root / "v1").glob("*.safetensors")
        assert _as_nobody_rename(bucket, node.stage_root, node.stage_root.parent) == ["denied"] * 3
        sender.commit()
        report = sender.last_report
        sender.close()
        assert report.committed == [str(endpoint)] and node.sink.version == 1
        assert torch.equal(node.sink.tensors["model.norm.weight"], _WEIGHTS["model.norm.weight"])
    finally:
        node.stop()


def _as_nobody_rename(*paths: Path) -> list[str]:
    """Each path renamed away by uid 65534 (in a forked child): 'denied' or 'renamed'."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read)
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            outcomes = []
            for path in paths:
                try:
                    os.rename(path, path.with_name(path.name + ".stolen"))
                    outcomes.append("renamed")
                except PermissionError:
                    outcomes.append("denied")
            os.write(write, " ".join(outcomes).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        outcomes = answer.read().split()
    os.waitpid(child, 0)
    return outcomes


# -- FIFO owner ------------------------------------------------------------------------------------------------


def test_a_fifo_planted_as_an_owner_file_does_not_hang_a_new_receiver(tmp_path):
    shared = _sticky(tmp_path)
    private = _private_parent(shared)
    private.mkdir(mode=0o700)
    planted = [shared / "areal-hex-planted", private / "areal-hex-planted"]
    for directory in planted:
        directory.mkdir()
        os.mkfifo(directory / ".owner")
    script = f"""
        from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
        from areal_hex_plugin.transport.sinks import MemorySink
        node = ReceiverNode(MemorySink(), ReceiverConfig(stage_dir={str(shared)!r}), token={TOKEN!r})
        print(node.stage_root.parent, flush=True)
        node.stop()
        """
    try:
        started = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            cwd=_REPO,
            env={"PYTHONPATH": str(_REPO), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the receiver hangs opening a planted FIFO .owner")
    assert started.returncode == 0, started.stderr[-2000:]
    assert started.stdout.strip() == str(private)
    assert all(stat.S_ISFIFO(os.lstat(d / ".owner").st_mode) for d in planted)  # left alone, not read
