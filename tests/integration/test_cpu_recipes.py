"""The CPU recipes as their headers run them: one override (``cluster.fileroot``) places every file of the run,
and ``recipes/ci/tiny.yaml`` runs the 20 steps in which its reward goes from ~0.25 to near 1 (README.md).

Run with the venv's real interpreter (``$(readlink -f .venv)/bin/python``) where ``.venv`` is a link: upstream's
loader finds the recipe by a path relative to its own module, which a linked venv resolves in the other checkout."""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from pathlib import Path

import pytest

pytest.importorskip("areal")

from tests.conftest import REPO  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("transport_token", "no_ray_cluster")]
CPU_RECIPES = [REPO / "recipes/ci/tiny.yaml", REPO / "recipes/ci/one_machine.yaml"]
# Every key of a run that names a file or folder of its own.
PATH_KEYS = (
    "cluster.fileroot",
    "cluster.name_resolve.nfs_record_root",
    "actor.path",
    "train_dataset.path",
    "hex.relay.stage_dir",
    "hex.relay.rollback_dir",
)


def header_command(recipe: Path) -> list[str]:
    """The words of the run command in the recipe's header comment, continuation lines joined."""
    header = [
        line.removeprefix("#").strip()
        for line in itertools.takewhile(lambda line: line.startswith("#"), recipe.read_text().splitlines())
    ]
    first = next(i for i, line in enumerate(header) if "python -m areal_hex_plugin.driver" in line)
    start = max(i for i in range(first + 1) if i == 0 or not header[i - 1].endswith("\\"))
    end = next(i for i in range(start, len(header)) if not header[i].endswith("\\"))
    text = " ".join(line.removesuffix("\\") for line in header[start : end + 1])
    return shlex.split(text[text.index("python -m areal_hex_plugin.driver") :])


def _strings(value) -> list[str]:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("recipe", CPU_RECIPES, ids=lambda p: p.name)
def test_the_header_command_places_every_file_of_the_run_with_one_override(
    recipe: Path, tmp_path: Path
) -> None:
    from areal_hex_plugin.areal.preflight import preflight

    words = header_command(recipe)
    assert words[:5] == ["python", "-m", "areal_hex_plugin.driver", "--config", str(recipe.relative_to(REPO))]
    overrides = [w.replace("$DIR", str(tmp_path)) for w in words[5:]]
    assert overrides == [f"cluster.fileroot={tmp_path}"]  # the one override: the folder of the run
    config = preflight(str(recipe), overrides, offline=True).config
    for key in PATH_KEYS:
        assert Path(_get(config, key)).is_relative_to(tmp_path), key
    default_root = recipe.read_text().split("fileroot:", 1)[1].split()[0]
    assert not [s for s in _strings(config) if default_root in s]  # no path left at the recipe's default


def test_the_tiny_recipe_runs_the_20_steps_its_header_and_the_readme_show(tmp_path: Path) -> None:
    from areal_hex_plugin.areal.preflight import preflight

    recipe = CPU_RECIPES[0]
    assert "In its 20 steps the mean reward goes from ~0.25 to near 1." in recipe.read_text()
    overrides = [w.replace("$DIR", str(tmp_path)) for w in header_command(recipe)[5:]]
    assert preflight(str(recipe), overrides, offline=True).config.total_train_steps == 20
