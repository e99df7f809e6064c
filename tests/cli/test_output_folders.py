"""Output folders are created as needed (every --json/--plot/--trace/--export path, reproduce --plots DIR); a file
in the way is refused before any work."""

from __future__ import annotations

from pathlib import Path

from areal_hex_plugin.cli import main
from tests.conftest import REPO

TINY = str(REPO / "recipes/ci/tiny.yaml")


def test_missing_folders_are_created_for_every_output(tmp_path: Path) -> None:
    plan = tmp_path / "a" / "b" / "plan.json"
    assert main(["plan", TINY, "--json", str(plan), "--plot", str(tmp_path / "c" / "frontier.png")]) == 0
    assert plan.is_file() and (tmp_path / "c" / "frontier.png").is_file()
    argv = ["simulate", TINY, "--plan", str(plan), "--steps", "2", "--json", str(tmp_path / "d" / "sim.json")]
    argv += ["--plot", str(tmp_path / "e" / "f" / "t.png"), "--trace", str(tmp_path / "g" / "trace.json")]
    assert main(argv) == 0
    assert (tmp_path / "d" / "sim.json").is_file() and (tmp_path / "g" / "trace.json").is_file()
    assert list((tmp_path / "e" / "f").glob("t*.png"))


def test_a_file_in_the_way_is_refused_before_any_work(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    assert main(["reproduce", "--plots", str(tmp_path / "file" / "plots")]) == 2
    out, err = capsys.readouterr()
    assert "--plots: " in err and "is a file, not a folder" in err and out == ""
    assert main(["plan", TINY, "--json", str(tmp_path / "file" / "plan.json")]) == 2
    assert "--json: " in capsys.readouterr().err
