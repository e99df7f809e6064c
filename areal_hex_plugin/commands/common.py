"""Pieces shared by subcommands: the recipe argument."""

from __future__ import annotations

import argparse


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (an upstream AReaL GRPO config with a hex: section)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="Hydra-style overrides, e.g. hex.solver.seed=1"
    )


def load_recipe_from_args(args: argparse.Namespace):
    from areal_hex_plugin.specs.recipe import load_recipe

    return load_recipe(args.recipe, args.overrides)
