"""Pieces shared by subcommands: the recipe argument."""

from __future__ import annotations

import argparse


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (an upstream AReaL GRPO config with a hex: section)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="Hydra overrides: key=value changes a key (e.g. gconfig.n_samples=8), +key=value adds one "
        "(e.g. +hex.solver.seed=1), ++key=value does either, ~key deletes one",
    )


def load_recipe_from_args(args: argparse.Namespace):
    from areal_hex_plugin.specs.recipe import load_recipe

    return load_recipe(args.recipe, args.overrides)
