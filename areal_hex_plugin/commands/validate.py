"""``areal-hex validate RECIPE``: check a recipe and print its cluster and workload."""

from __future__ import annotations

import argparse

from areal_hex_plugin.commands.common import add_recipe_arguments, load_recipe_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("validate", help="check a recipe and print its cluster and workload summary")
    add_recipe_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.specs.summary import describe_recipe

    recipe = load_recipe_from_args(args)
    print(describe_recipe(recipe))
    print(f"\n{args.recipe}: valid (the hex: section and the upstream keys the planner reads; `areal-hex check` also "
          "loads the whole upstream config, the workflow, the token and the live inventory)")  # fmt: skip
    return 0
