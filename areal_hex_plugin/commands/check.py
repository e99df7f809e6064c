"""``areal-hex check RECIPE``: the pre-flight the driver runs before it starts anything (``areal/preflight.py``):
the whole upstream config, the workflow and reward function, the transport's token, the plan and its budget, and
the live inventory against the plan."""

from __future__ import annotations

import argparse
import shlex

from areal_hex_plugin.commands.common import add_recipe_arguments


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "check",
        help="pre-flight: load the whole upstream config, the workflow, the token, the plan and the live "
        "inventory, as the driver does before it starts",
    )
    add_recipe_arguments(parser)
    parser.add_argument(
        "--offline",
        action="store_true",
        help="skip the live inventory (check a recipe away from its cluster)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.areal.preflight import preflight
    from areal_hex_plugin.progress import working

    with working(f"checking {args.recipe}"):
        checked = preflight(args.recipe, args.overrides, offline=args.offline)
    for line in checked.passed:
        print(f"ok   {line}")
    for line in checked.notes:
        print(f"note {line}")
    command = shlex.join(
        ["python", "-m", "areal_hex_plugin.driver", "--config", args.recipe, *args.overrides]
    )
    print(f"\n{args.recipe}: ready to run: {command}")
    return 0
