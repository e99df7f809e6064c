"""The plan for a loaded ``HexGRPOConfig``, for a scheduler or trainer built from ``exp_config`` alone."""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.specs.recipe import Recipe, load_recipe


def recipe_of(config) -> Recipe:
    """The core reader's view of a loaded config, checked as ``areal-hex validate`` checks a recipe file.

    Relative paths in the ``hex:`` section (an output-length file, a calibration profile) are read from the
    current directory, as upstream reads its own relative paths."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
    with tempfile.TemporaryDirectory(prefix="areal-hex-") as folder:
        file = Path(folder) / "recipe.yaml"
        file.write_text(yaml.safe_dump(data))
        return load_recipe(file, base_dir=Path.cwd())


def plan_for(config) -> tuple[HexPlan, str]:
    """The plan at ``hex.plan_path`` (checked against the config), or one solved now; and where it came from."""
    from areal_hex_plugin.driver import obtain_plan

    return obtain_plan(recipe_of(config), config)
