"""``areal-hex replan --plan OLD.json --lost HOSTS [--gained POOL=HOSTS]``: the plan after machines come and go.

The smallest change the objective allows (``planner/replan.py``): a lost rollout machine changes only the
rollout shares; a lost training machine re-plans the recipe on the machines left, keeping every machine's role
where the new plan allows. Prints which machines change role or layout and the predicted tokens/s before and
after; ``--json OUT`` writes the new plan (with the change recorded in its ``changes``) for ``hex.plan_path``.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "replan", help="re-plan after machines are lost or gained, moving only what the objective needs"
    )
    parser.add_argument("--plan", required=True, metavar="OLD.json", help="the plan the run was following")
    parser.add_argument(
        "--lost", default="", metavar="HOSTS", help="comma-separated hosts that are gone (e.g. big-1,small-0)"
    )
    parser.add_argument(
        "--gained",
        action="append",
        default=[],
        metavar="POOL=HOSTS",
        help="new machines of a pool of the recipe, comma-separated hosts (repeat per pool)",
    )
    parser.add_argument(
        "--recipe", metavar="RECIPE", help="the recipe the plan was made for (default: the plan's own recipe)"
    )
    parser.add_argument("--json", metavar="OUT", help="write the new plan as JSON; - for stdout")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="the overrides the run gave the recipe (Hydra grammar)",
    )
    parser.set_defaults(run=run)


def parse_gained(items: list[str]) -> dict[str, list[str]]:
    """``POOL=h1,h2`` items -> {pool: [hosts]}; HexError names ``--gained`` for a malformed one."""
    from areal_hex_plugin.errors import HexError

    gained: dict[str, list[str]] = {}
    for item in items:
        pool, sep, hosts = item.partition("=")
        names = [h.strip() for h in hosts.split(",") if h.strip()]
        if not sep or not pool.strip() or not names:
            raise HexError("--gained", f"{item!r} is not POOL=HOSTS", "write e.g. --gained big=big-3,big-4")
        gained.setdefault(pool.strip(), []).extend(names)
    return gained


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.errors import HexError
    from areal_hex_plugin.outfiles import check_writable, console, write_json
    from areal_hex_plugin.plan import HexPlan
    from areal_hex_plugin.planner.replan import replan
    from areal_hex_plugin.specs.recipe import load_recipe

    check_writable(args.json, "--json")
    out = console(args.json)
    lost = [h.strip() for h in args.lost.split(",") if h.strip()]
    gained = parse_gained(args.gained)
    if not lost and not gained:
        raise HexError("--lost", "names no host (and nothing is --gained)", "give e.g. --lost big-1")
    old = HexPlan.load(args.plan, "--plan")
    recipe = load_recipe(args.recipe or old.recipe, args.overrides)
    result = replan(recipe, old, lost, gained)
    print(describe_replan(result), file=out)
    if args.json:
        print(f"\nplan written to {write_json(args.json, result.plan.to_dict())}", file=out)
    return 0


def describe_replan(result) -> str:
    """The diff: each machine that changes role or layout, and the predicted tokens/s before and after."""
    from areal_hex_plugin.tables import render_table

    rows = [[d.host, d.pool, d.before or "(new)", d.after or "(gone)"] for d in result.diff]
    change = result.plan.changes[-1]
    before, after = change.tokens_per_s_before, change.tokens_per_s_after
    lines = [change.reason, ""]
    lines.append(
        render_table(["host", "pool", "before", "after"], rows)
        if rows
        else "no machine changes role or layout"
    )
    lines.append("")
    lines.append(
        f"predicted tokens/s: {before:,.1f} -> {after:,.1f} ({(after / before - 1) * 100 if before else 0:+.1f}%)"
    )
    shares = ", ".join(
        f"{g.pool} tp{g.tp}pp{g.pp} x{g.count}: {g.share:.3f}" for g in result.plan.rollout.replicas
    )
    lines.append(f"rollout shares: {shares}")
    return "\n".join(lines)
