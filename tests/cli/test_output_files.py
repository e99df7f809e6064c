"""Output files: ``-`` is stdout, special files are written in place, regular files atomically with the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.outfiles import write_json
from tests.conftest import REPO

PAPER_7B = str(REPO / "recipes/paper/7b.yaml")


def test_dash_is_stdout_and_the_table_moves_to_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", PAPER_7B, "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)["per_gpu_type"]) == {"H20", "H800-PCIe"}  # stdout is pure JSON
    assert "rollout tok/s/GPU" in captured.err
    assert not (tmp_path / "-").exists()


def _read_fifo(path, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(path, "rb") as handle:
            into.append(handle.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("through_symlink", [False, True])
def test_a_special_file_is_written_in_place_never_replaced(tmp_path, through_symlink):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    target = fifo
    if through_symlink:  # like /dev/stdout -> /proc/self/fd/1
        target = tmp_path / "stdout"
        target.symlink_to(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    write_json(target, {"a": 1})
    reader.join(timeout=10)
    assert json.loads(got[0]) == {"a": 1}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert target.is_symlink() == through_symlink
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_mode_the_umask_gives(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = write_json(tmp_path / "out.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_replaced_file_keeps_its_mode_and_a_symlink_stays_a_symlink(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("{}")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_json(link, {"b": 2})
    assert link.is_symlink() and json.loads(real.read_text()) == {"b": 2}
    assert stat.S_IMODE(real.stat().st_mode) == 0o640


def test_a_folder_is_refused_and_a_missing_folder_is_created(tmp_path):
    with pytest.raises(HexError, match="is a folder"):
        write_json(tmp_path, {})
    assert json.loads(write_json(tmp_path / "no" / "such" / "x.json", {"a": 1}).read_text()) == {"a": 1}
    (tmp_path / "file").write_text("")
    with pytest.raises(HexError, match="is a file, not a folder"):
        write_json(tmp_path / "file" / "x.json", {})


def test_plan_json_and_plot_to_stdout(tmp_path, monkeypatch, capsysbinary):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", PAPER_7B, "--json", "-"]) == 0
    out = capsysbinary.readouterr()
    assert json.loads(out.out)["schema_version"] >= 1 and b"Binding constraint" in out.err
    assert main(["plan", PAPER_7B, "--plot", "-"]) == 0
    assert capsysbinary.readouterr().out.startswith(b"\x89PNG")
    assert list(tmp_path.iterdir()) == []


def test_dev_stdout_redirected_to_a_file_is_written_into_that_same_file(tmp_path):
    out = tmp_path / "out.txt"
    code = "from areal_hex_plugin.outfiles import write_json; print('table'); write_json('/dev/stdout', {'a': 1})"
    with open(out, "w") as handle:
        before = os.fstat(handle.fileno()).st_ino
        subprocess.run([sys.executable, "-c", code], stdout=handle, check=True, cwd=REPO)
    assert out.stat().st_ino == before  # the shell's file, not a replacement
    assert out.read_text().startswith("table\n") and json.loads(out.read_text().split("\n", 1)[1]) == {"a": 1}
