"""``areal-hex simulate RECIPE``: play a plan through a discrete-event model of AReaL's asynchronous loop."""

from __future__ import annotations

import argparse
import dataclasses

from areal_hex_plugin.commands.common import add_recipe_arguments, load_recipe_from_args
from areal_hex_plugin.errors import HexError

# The simulator plays every sample (about 15 µs each): these bound a run to about half a minute.
MAX_STEPS = 10_000
MAX_SAMPLES = 2_000_000
SCHEMA_VERSION = 1  # of the --json document (areal_hex_plugin/schemas/simulate.schema.json)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "simulate", help="simulate a plan event by event: steady tokens/s, step breakdown, idle, staleness"
    )
    add_recipe_arguments(parser)
    parser.add_argument(
        "--plan", metavar="PLAN.json", help="a plan from `areal-hex plan --json` (default: plan now)"
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps to simulate (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for output lengths (default 0)")
    parser.add_argument(
        "--no-kv-recompute",
        action="store_true",
        help="what-if: interrupted sequences keep their KV cache across weight updates (upstream re-prefills)",
    )
    parser.add_argument(
        "--faults",
        metavar="FILE",
        help="replay timed machine losses, returns and length drift (a YAML faults file, see "
        "recipes/faults/); prints the per-step timeline beside the same run without them",
    )
    parser.add_argument(
        "--truth",
        metavar="PROFILE",
        help="run the machines on this profile's factors (as they are) while the planner starts from the "
        "recipe's (as believed), refitting and re-planning online; prints tokens/s per step beside the believed "
        "and the true-factor plans, when the refit converged and the gap recovered",
    )
    parser.add_argument(
        "--refit-every",
        type=int,
        default=None,
        metavar="N",
        help="with --truth: steps between refits and re-plan decisions (default 5)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the simulation results as JSON; - for stdout")
    parser.add_argument(
        "--plot",
        metavar="OUT.png",
        help="draw every pool's timeline over the last steps in one figure, step boundaries marked; - for stdout",
    )
    parser.add_argument(
        "--trace",
        metavar="OUT.json",
        help="write the whole run, every replica, as a Chrome/Perfetto trace (ui.perfetto.dev); - for stdout",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.outfiles import check_writable, console, write_json
    from areal_hex_plugin.planner import plan_recipe
    from areal_hex_plugin.progress import working
    from areal_hex_plugin.saved_plan import load_saved_plan
    from areal_hex_plugin.sim.agreement import plan_gap
    from areal_hex_plugin.sim.engine import simulate
    from areal_hex_plugin.sim.inputs import sim_spec
    from areal_hex_plugin.sim.report import describe_simulation

    if not 1 <= args.steps <= MAX_STEPS:
        raise HexError(
            "--steps",
            f"must be in [1, {MAX_STEPS:,}], got {args.steps}",
            "simulate 30 steps, as the paper does",
        )
    _check_truth(args)
    check_writable(args.json, "--json")
    check_writable(args.trace, "--trace")
    check_writable(args.plot, "--plot")
    out = console(args.json, args.trace, args.plot)
    recipe = load_recipe_from_args(args)
    samples = args.steps * recipe.workload.rl.samples_per_step
    if samples > MAX_SAMPLES:
        raise HexError(
            "--steps",
            f"{args.steps} steps of {recipe.workload.rl.samples_per_step:,} samples are {samples:,} samples to "
            f"play, more than {MAX_SAMPLES:,} (about half a minute)",
            f"simulate at most {max(1, MAX_SAMPLES // recipe.workload.rl.samples_per_step)} steps",
        )
    with working(f"simulating {args.steps} steps of {args.recipe}"):
        plan = load_saved_plan(args.plan, recipe, "--plan") if args.plan else plan_recipe(recipe)
        spec = sim_spec(recipe, plan)
        if args.no_kv_recompute:
            spec = dataclasses.replace(spec, kv_recompute=False)
        timeline = bool(args.plot or args.trace)
        truth = None
        if args.truth:
            from areal_hex_plugin.sim.online import EVERY, read_truth, simulate_truth

            truth = simulate_truth(
                recipe, plan, read_truth(args.truth, recipe), args.steps, args.seed, args.refit_every or EVERY
            )
        if args.faults:
            from areal_hex_plugin.sim.faults import simulate_faults

            # The plan's own figures from the run without the events; the timelines show the run with them.
            faults = simulate_faults(recipe, plan, spec, args.faults, args.steps, args.seed, timeline)
            result, shown = faults.clean.result, faults.hit.result
        else:
            faults, result = None, simulate(spec, steps=args.steps, seed=args.seed, timeline=timeline)
            shown = result
    print(describe_simulation(result, plan, out), file=out)
    if faults:
        from areal_hex_plugin.sim.faults import describe_faults

        print(f"\n{describe_faults(faults, out)}", file=out)
    if truth:
        from areal_hex_plugin.sim.online import describe_truth

        print(f"\n{describe_truth(truth, args.truth, out)}", file=out)
    if args.json:
        data = {
            "schema_version": SCHEMA_VERSION,
            "recipe": str(recipe.path),
            "seed": args.seed,
            "kv_recompute": spec.kv_recompute,
            "predicted": dataclasses.asdict(plan.predicted),
        }
        data.update(result.to_dict())
        gap = plan_gap(result, plan)
        data["plan_gap"] = {"relative": gap.relative, "reason": gap.reason} if gap else None
        if faults:
            data["faults"] = faults.to_dict()
        if truth:
            data["truth"] = {"file": args.truth, **truth.to_dict()}
        print(f"\nresults written to {write_json(args.json, data)}", file=out)
    if args.trace:
        from areal_hex_plugin.sim.trace import chrome_trace

        trace = chrome_trace(shown, f"{recipe.workload.model.name}: {args.recipe}")
        print(f"trace written to {write_json(args.trace, trace, '--trace')}", file=out)
    if args.plot:
        from areal_hex_plugin.sim.plot import plot_timelines

        print(f"timeline plotted to {plot_timelines(shown, args.plot, recipe.workload.model.name)}", file=out)
    return 0


def _check_truth(args: argparse.Namespace) -> None:
    """--truth plays its own runs: refuse what it cannot be combined with."""
    if args.refit_every is not None and not args.truth:
        raise HexError("--refit-every", "needs --truth", "add --truth PROFILE")
    if not args.truth:
        return
    if args.refit_every is not None and not 1 <= args.refit_every <= args.steps:
        raise HexError(
            "--refit-every", f"must be in [1, --steps={args.steps}], got {args.refit_every}", "e.g. 5"
        )
    for flag in ("faults", "plot", "trace"):
        if getattr(args, flag):
            raise HexError("--truth", f"cannot be combined with --{flag}", f"drop --{flag} or --truth")
