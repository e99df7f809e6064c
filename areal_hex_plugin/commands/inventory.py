"""``areal-hex inventory --from ray|slurm|local``: write a ``hex: cluster:`` section for the machines found."""

from __future__ import annotations

import argparse

from areal_hex_plugin.outfiles import is_stdout, write_output


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "inventory", help="discover GPU machines (Ray, Slurm or this machine) and write a hex.cluster section"
    )
    parser.add_argument("--from", dest="source", required=True, choices=("ray", "slurm", "local"))
    parser.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    parser.add_argument(
        "--out", default=None, metavar="FILE", help="write the YAML here (default or -: stdout)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.inventory import discover, render_cluster_yaml
    from areal_hex_plugin.progress import working

    with working(f"asking {args.source} for its machines"):
        machines = discover(args.source, args.address)
    text = render_cluster_yaml(machines, args.source)
    if args.out and not is_stdout(args.out):
        path = write_output(args.out, text, what="--out")
        print(f"wrote {path}; fill in price_per_gpu_hour for every pool before planning")
    else:
        print(text, end="")
    return 0
