"""``areal-hex``: plan, estimate, simulate and inspect AReaL-Hex recipes.

Each subcommand lives in ``areal_hex_plugin.commands.<name>`` with ``add_parser(subparsers)`` and
``run(args) -> int``; heavy imports stay inside ``run`` so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys

from areal_hex_plugin import __version__
from areal_hex_plugin.commands.common import NOTES, refuse_several_recipes
from areal_hex_plugin.errors import HexError

COMMANDS = (
    "validate",
    "check",
    "inventory",
    "catalog",
    "estimate",
    "plan",
    "profile",
    "calibrate",
    "simulate",
    "reproduce",
    "replan",
    "join",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="areal-hex",
        description="Heterogeneity-aware planning for asynchronous RL (AReaL) on mixed GPU clusters.",
    )
    parser.add_argument("--version", action="version", version=f"areal-hex {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"areal_hex_plugin.commands.{name}").add_parser(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with Hydra overrides anywhere after the recipe (``plan R --json out.json a=1 --pareto``),
    as AReaL users write them; any other unknown word is refused."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    flags = [word for word in extra if word.startswith("-") or not hasattr(args, "overrides")]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def pasteable(fix: str, recipe: str | None, plan: str | None = None) -> str:
    """A fix's (or a note's) command lines name the recipe (and the saved plan) this command was given, so they
    run when pasted."""
    for word, value in ((r"RECIPE", recipe), (r"PLAN(?:\.json)?", plan)):
        if value:
            fix = re.sub(rf"\b{word}\b", lambda _, v=value: shlex.quote(v), fix)
    return fix


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    NOTES.clear()
    try:
        if getattr(args, "recipe", None) and hasattr(args, "overrides"):
            refuse_several_recipes(args.command, args.recipe, args.overrides)
        code = args.run(args)
        sys.stdout.flush()  # the notes follow the output, also when both go to one terminal
        for note in NOTES:
            print(pasteable(str(note), getattr(args, "recipe", None)), file=sys.stderr)
        return code
    except HexError as exc:
        exc.fix = pasteable(exc.fix, getattr(args, "recipe", None), getattr(args, "plan", None))
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
