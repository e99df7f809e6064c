"""The core reader (omegaconf, no areal) and upstream's load_expr_config read every recipe the same way."""

from __future__ import annotations

import dataclasses

import pytest

from areal_hex_plugin.specs.recipe import UPSTREAM_FIELDS, load_recipe
from tests.conftest import RECIPES

pytestmark = pytest.mark.integration


def _select(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_both_readers_agree(recipe, tmp_path):
    from areal_hex_plugin.areal.config import load_hex_config

    fileroot = f"cluster.fileroot={tmp_path}"
    overrides = [fileroot, f"cluster.name_resolve.nfs_record_root={tmp_path}/nr", "++hex.solver.seed=7"]
    upstream_cfg, _ = load_hex_config(["--config", str(recipe), *overrides])
    core = load_recipe(recipe, overrides)

    assert dataclasses.asdict(upstream_cfg.hex) == dataclasses.asdict(core.hex)
    assert core.hex.solver.seed == 7
    for key in UPSTREAM_FIELDS:
        assert _select(upstream_cfg, key) == core.upstream[key], key


def test_upstream_defaults_match_the_core_reader():
    """UPSTREAM_FIELDS carries upstream's defaults so the core needs no areal import to apply them."""
    from areal.api.cli_args import GRPOConfig

    defaults = GRPOConfig.__dataclass_fields__
    for key, (_, default, _meta) in UPSTREAM_FIELDS.items():
        section, *names = key.split(".")
        value = defaults[section].default_factory()
        for name in names:
            value = getattr(value, name)
        assert value == default, key


def test_hex_section_lands_in_upstream_config_object(tmp_path):
    from areal_hex_plugin.areal.config import HexGRPOConfig, load_hex_config

    cfg, _ = load_hex_config(
        [
            "--config",
            str(RECIPES[0]),
            f"cluster.fileroot={tmp_path}",
            f"cluster.name_resolve.nfs_record_root={tmp_path}/nr",
            "hex.cluster.pools.0.machines=3",
        ]
    )
    assert isinstance(cfg, HexGRPOConfig)
    assert cfg.hex.cluster.pools[0].machines == 3
