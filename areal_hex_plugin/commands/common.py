"""Pieces shared by subcommands: the recipe argument and atomic output files."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from areal_hex_plugin.errors import HexError


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (an upstream AReaL GRPO config with a hex: section)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="Hydra-style overrides, e.g. hex.solver.seed=1"
    )


def load_recipe_from_args(args: argparse.Namespace):
    from areal_hex_plugin.specs.recipe import load_recipe

    return load_recipe(args.recipe, args.overrides)


def write_atomic(path: str | Path, text: str, what: str = "--json") -> Path:
    """Write ``text`` to ``path`` all at once (a temp file renamed into place): never a half-written file."""
    target = Path(path).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise HexError(what, f"folder {parent} does not exist", "create it first or write somewhere else")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except OSError as exc:
        raise HexError(what, f"cannot write {target}: {exc.strerror}", "choose a writable path") from None
    return target


def write_json(path: str | Path, data: Any, what: str = "--json") -> Path:
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n", what)
