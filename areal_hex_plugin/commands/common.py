"""Pieces shared by subcommands: the recipe argument."""

from __future__ import annotations

import argparse


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (an upstream AReaL GRPO config with a hex: section)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="Hydra overrides: key=value changes a key the recipe has (e.g. gconfig.n_samples=8), "
        "+key=value adds one, ++key=value does either (e.g. ++hex.solver.seed=1), ~key deletes one",
    )


# Warnings and result-changing defaults of the recipe a command loaded; ``cli.main`` prints them on stderr once
# the command has succeeded (bad input stays one message).
NOTES: list = []


def load_recipe_from_args(args: argparse.Namespace):
    from areal_hex_plugin.specs.advice import recipe_notes
    from areal_hex_plugin.specs.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    NOTES.extend(recipe_notes(recipe))
    return recipe
