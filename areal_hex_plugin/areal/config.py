"""``HexGRPOConfig``: upstream's GRPO experiment config with a ``hex:`` section, loadable by ``load_expr_config``."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal.api.cli_args import GRPOConfig, load_expr_config

from areal_hex_plugin.specs.config import HexConfig


@dataclass
class HexGRPOConfig(GRPOConfig):
    """An upstream AReaL GRPO config plus the plugin's ``hex:`` section (cluster, objective, solver, transport)."""

    hex: HexConfig = field(default_factory=HexConfig)


def load_hex_config(argv: list[str]) -> tuple[HexGRPOConfig, str]:
    """Load a recipe exactly as upstream loads an experiment: ``--config FILE`` plus Hydra overrides."""
    return load_expr_config(argv, HexGRPOConfig)
