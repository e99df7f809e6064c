"""Pieces shared by subcommands: the recipe argument."""

from __future__ import annotations

import argparse
from pathlib import Path

from areal_hex_plugin.errors import HexError

RECIPE_SUFFIXES = (".yaml", ".yml")


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (an upstream AReaL GRPO config with a hex: section)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="Hydra overrides: key=value changes a key the recipe has (e.g. gconfig.n_samples=8), "
        "+key=value adds one, ++key=value does either (e.g. ++hex.solver.seed=1), ~key deletes one",
    )


def is_recipe_path(word: str) -> bool:
    """Whether a word after the recipe names another recipe file rather than an override (no ``=``)."""
    if "=" in word or word.startswith("~"):
        return False
    return word.endswith(RECIPE_SUFFIXES) or Path(word).is_file()


def refuse_several_recipes(command: str, recipe: str, overrides: list[str]) -> None:
    """One recipe per command: recipe paths among the overrides (a shell glob such as ``recipes/mixes/*.yaml``)
    are refused as such, naming them all, before any override is parsed."""
    more = [word for word in overrides if is_recipe_path(word)]
    if more:
        given = [recipe, *more]
        raise HexError(
            "", f"{command} takes one recipe; got {len(given)}: {' '.join(given)}", "run it once per recipe"
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
