"""Overrides anywhere on the line, as AReaL users write them, and every fix an error suggests runs when pasted:
each test runs the command, takes the fix from the message, applies it as told and runs again."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from areal_hex_plugin.cli import main
from tests.conftest import REPO

TINY = str(REPO / "recipes/ci/tiny.yaml")
MIX = str(REPO / "recipes/mixes/a100_l40s_qwen2.5-7b.yaml")


def _fix(capsys, *argv: str) -> str:
    """Run ``areal-hex *argv``: exit 2 and one error; its fix."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    return err.split("  fix: ", 1)[1].strip()


def _run_pasted(command: str) -> int:
    """Run a command line as a user pastes it (``areal-hex ...``)."""
    words = shlex.split(command)
    assert words[0] == "areal-hex"
    return main(words[1:])


def test_overrides_go_anywhere_after_the_recipe(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", TINY, "--json", str(out), "hex.solver.seed=1", "--pareto", "gconfig.n_samples=4"]
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    assert plan["pareto"]  # the flag after an override was taken
    assert main(["validate", TINY, "gconfig.n_samples=4", "hex.solver.seed=1"]) == 0
    capsys.readouterr()
    # An override placed after flags is applied: a bad one is refused by name.
    assert "hex.solver.sed: is not a key" in _fix_message(
        capsys, "plan", TINY, "--pareto", "hex.solver.sed=1"
    )


def _fix_message(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_an_unknown_flag_is_still_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", TINY, "hex.solver.seed=1", "--jsn", "out.json"])
    assert exit_.value.code == 2 and "error: unrecognized arguments: --jsn" in capsys.readouterr().err


def test_the_exhaustive_hint_works_appended_as_suggested(capsys) -> None:
    argv = ["plan", MIX, "--exhaustive"]
    fix = _fix(capsys, *argv)
    override = re.fullmatch(r"append (\S+) to the command .*", fix).group(1)
    assert main([*argv, override]) == 0


def test_a_misspelt_objective_key_is_told_the_right_key_first(capsys) -> None:
    fix = _fix(capsys, "validate", MIX, "hex.objective.budget_per_hr=60")
    override = re.fullmatch(r"did you mean \S+\? write (\S+)", fix).group(1)
    assert override == "hex.objective.budget_per_hour=60"
    assert main(["validate", MIX, override]) == 0


def test_a_key_of_the_config_class_needs_no_plus(capsys) -> None:
    assert "objective:" not in Path(MIX).read_text()
    assert main(["validate", MIX, "hex.objective.budget_per_hour=40"]) == 0


@pytest.mark.parametrize(
    ("override", "expected"),
    [("+gconfig.n_samples=4", "write gconfig.n_samples=4"), ("actor.not_here=1", "write +actor.not_here=1")],
    ids=["added-but-present", "absent-upstream-key"],
)
def test_the_override_fixes_run(override: str, expected: str, capsys) -> None:
    fix = _fix(capsys, "validate", TINY, override)
    assert fix.startswith(expected)
    assert main(["validate", TINY, expected.split()[1]]) == 0


def test_the_over_budget_fix_replans_within_the_budget(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "plan.json"
    assert main(["plan", MIX, "--json", str(plan)]) == 0  # the whole inventory, $49.76/h
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        Path(MIX)
        .read_text()
        .replace("  transport: relay", "  objective:\n    budget_per_hour: 40\n  transport: relay")
    )
    argv = ["simulate", str(recipe), "--plan", str(plan), "--steps", "1"]
    fix = _fix(capsys, *argv)
    command = re.match(r"re-plan within the budget: (areal-hex [^;]+);", fix).group(1)
    assert _run_pasted(command) == 0
    assert main(argv) == 0


def test_a_plan_for_another_model_is_told_the_command_that_replans_it(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "plan.json"
    assert main(["plan", TINY, "--json", str(plan)]) == 0
    argv = ["simulate", MIX, "--plan", str(plan), "--steps", "1"]
    fix = _fix(capsys, *argv)
    command = re.search(r"\((areal-hex [^)]+)\)", fix).group(1)
    assert command == f"areal-hex plan {MIX} --json {plan}"  # this recipe and this plan, not placeholders
    assert _run_pasted(command) == 0
    assert main(argv) == 0
