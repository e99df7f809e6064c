"""``areal-hex reproduce``: the paper's experiments through our planner and simulator, as paper-style tables."""

from __future__ import annotations

import argparse
from pathlib import Path

from areal_hex_plugin.errors import HexError

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "paper"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "reproduce",
        help="re-run the paper's experiments (equal budget, equal throughput, ablation, solve time)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON; - for stdout")
    parser.add_argument(
        "--plots", metavar="DIR", help="draw each simulated plan's timelines into DIR (created if missing)"
    )
    parser.add_argument(
        "--recipes", metavar="DIR", default=str(RECIPES), help="folder with 1.5b.yaml, 7b.yaml, 14b.yaml"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from areal_hex_plugin.outfiles import check_folder, check_writable, console, write_json
    from areal_hex_plugin.sim.reproduce import MODELS, reproduce, tables

    folder = Path(args.recipes).expanduser()
    missing = [f for f in MODELS.values() if not (folder / f).is_file()]
    if missing:
        raise HexError("--recipes", f"{folder} lacks {', '.join(missing)}", "point at recipes/paper")
    if args.plots:
        check_folder(args.plots, "--plots")  # created when the first plot is written
    check_writable(args.json, "--json")
    con = console(args.json)
    out, runs = reproduce(
        folder, progress=lambda line: print(line, file=sys.stderr), timeline=bool(args.plots)
    )
    print(tables(out, con), file=con)
    if args.json:
        print(f"\nresults written to {write_json(args.json, out)}", file=con)
    if args.plots:
        from areal_hex_plugin.sim.plot import plot_timelines

        folder = Path(args.plots).expanduser()
        for name, result in runs.items():
            path = plot_timelines(result.result, folder / f"{name}.png", title=name)
            print(f"{name}: timelines in {path.name}", file=con)
    return 0
