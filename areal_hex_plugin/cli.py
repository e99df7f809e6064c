"""``areal-hex``: plan, estimate, simulate and inspect AReaL-Hex recipes.

Each subcommand lives in ``areal_hex_plugin.commands.<name>`` with ``add_parser(subparsers)`` and
``run(args) -> int``; heavy imports stay inside ``run`` so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from areal_hex_plugin import __version__
from areal_hex_plugin.commands.common import NOTES
from areal_hex_plugin.errors import HexError

COMMANDS = (
    "validate",
    "inventory",
    "catalog",
    "estimate",
    "plan",
    "profile",
    "calibrate",
    "simulate",
    "reproduce",
    "replan",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    NOTES.clear()
    try:
        code = args.run(args)
        sys.stdout.flush()  # the notes follow the output, also when both go to one terminal
        for note in NOTES:
            print(note, file=sys.stderr)
        return code
    except HexError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
