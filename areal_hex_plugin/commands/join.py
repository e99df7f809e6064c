"""``areal-hex join --plan RUN/hex_plan.json --pool POOL --host HOST``: a machine joins a running plan.

Records the request in ``hex_join.jsonl`` beside the run's plan (``joins.py``), after checking it: the pool is one of
the plan's, the host is not another pool's machine and not in use (training, serving, or already asked for). The
run's elastic watcher then starts the machine's rollout servers; each receives the trainer's next committed version
over the relay before it takes requests, and the shares are re-solved for the larger fleet (see "Elastic runs").
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("join", help="add a machine of a known pool to a running plan's rollout servers")
    parser.add_argument(
        "--plan", required=True, metavar="RUN/hex_plan.json", help="the plan the run keeps beside its config"
    )
    parser.add_argument("--pool", required=True, help="the recipe's pool the machine belongs to")
    parser.add_argument(
        "--host", required=True, help="the machine's host name (a new one, or one lost earlier)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.joins import append_request, check_join, join_file, read_requests
    from areal_hex_plugin.plan import HexPlan

    plan = HexPlan.load(args.plan, "--plan")
    path = join_file(args.plan)
    requests, _ = read_requests(path)
    check_join(plan, requests, args.pool, args.host)
    index = append_request(path, args.pool, args.host)
    print(
        f"join request {index}: {args.host} (pool {args.pool}) written to {path}. The run starts its rollout "
        "servers; each serves once it holds the trainer's next committed version, and the shares are re-solved "
        f"then (a 'gained' change naming join request {index} in {args.plan})"
    )
    return 0
