"""A command takes one recipe: several recipe paths (``areal-hex check recipes/mixes/*.yaml``) are refused as such,
in one message naming them, by every command that takes a recipe and overrides, and by the driver."""

from __future__ import annotations

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.driver import main as driver_main
from tests.conftest import REPO

MIXES = sorted(str(p) for p in (REPO / "recipes/mixes").glob("*.yaml"))


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "command",
    [
        ["check", "--offline"],
        ["validate"],
        ["plan"],
        ["simulate"],
        ["estimate"],
        ["profile", "--gpu-type", "H100", "--json", "/dev/null"],
    ],
    ids=lambda c: c[0],
)
def test_several_recipes_are_refused_naming_them(command: list[str], capsys) -> None:
    name, flags = command[0], command[1:]
    assert main([name, *MIXES, "hex.solver.seed=1", *flags]) == 2
    err = _one_error(capsys)
    assert f"error: {name} takes one recipe; got 3: {' '.join(MIXES)}" in err, err
    assert "run it once per recipe" in err and "is not key=value" not in err


def test_the_driver_refuses_several_recipes(capsys) -> None:
    assert driver_main(["--config", MIXES[0], MIXES[1]]) == 2
    err = _one_error(capsys)
    assert f"takes one recipe; got 2: {MIXES[0]} {MIXES[1]}" in err and "is not key=value" not in err, err


def test_a_word_without_equals_that_is_no_recipe_is_still_not_key_value(capsys) -> None:
    assert main(["validate", MIXES[0], "hex.solver.seed"]) == 2
    assert "override 'hex.solver.seed': is not key=value" in _one_error(capsys)
