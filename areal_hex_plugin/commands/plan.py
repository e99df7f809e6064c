"""``areal-hex plan RECIPE``: solve the two-phase schedule for the recipe's backends (the plan the driver runs) and
print it beside the homogeneous baselines and the recipe's allocation as written; ``--unconstrained`` adds the
paper's unconstrained plan; ``--as-written`` scores the recipe's ``actor.backend`` and ``rollout.backend`` alone."""

from __future__ import annotations

import argparse

from areal_hex_plugin.commands.common import add_recipe_arguments, load_recipe_from_args
from areal_hex_plugin.outfiles import check_writable, console
from areal_hex_plugin.progress import working


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="plan which machines train and which generate, with layouts, predicted tokens/s and $/h",
    )
    add_recipe_arguments(parser)
    objective = parser.add_mutually_exclusive_group()
    objective.add_argument(
        "--budget",
        type=float,
        metavar="USD_PER_HOUR",
        help="max tokens/s within this $/h (overrides the recipe)",
    )
    objective.add_argument(
        "--target-tokens-per-s",
        type=float,
        metavar="N",
        help="min $/h reaching N tokens/s (overrides the recipe)",
    )
    parser.add_argument(
        "--exhaustive",
        action="store_true",
        help="score every machine split (the true optimum; small clusters)",
    )
    parser.add_argument("--pareto", action="store_true", help="also compute the cost vs tokens/s frontier")
    parser.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="run length the $ and hours beside the plan are for (default: 100 training steps)",
    )
    parser.add_argument(
        "--unconstrained",
        action="store_true",
        help="also plan in the paper's unconstrained space (layouts upstream cannot start) and show the "
        "difference; the plan printed first and written by --json stays the runnable one",
    )
    parser.add_argument(
        "--as-written",
        action="store_true",
        help="no search: score the recipe's own actor.backend and rollout.backend (e.g. megatron:d4p2t1 and "
        "sglang:d4p1t2) on its cluster, placed as upstream places them",
    )
    parser.add_argument("--json", metavar="OUT", help="write the plan (HexPlan JSON) here; - for stdout")
    parser.add_argument(
        "--plot", metavar="OUT.png", help="draw the Pareto frontier (implies --pareto); - for stdout"
    )
    parser.add_argument(
        "--export",
        nargs=2,
        metavar=("slurm|ray|skypilot", "OUT"),
        help="write a job that runs the driver with this plan: an sbatch script, a Ray Jobs submission (JSON) "
        "or a SkyPilot job group (YAML); the plan goes beside it as <OUT stem>.plan.json",
    )
    parser.add_argument(
        "--job-python",
        metavar="PATH",
        help="the python the exported slurm or ray job runs the driver with (its ray beside it); default: this one",
    )
    parser.add_argument(
        "--accelerator-map",
        action="append",
        default=[],
        metavar="TYPE=NAME",
        help="the name the export's scheduler knows a GPU type by (SkyPilot accelerator, Slurm GRES type); "
        "repeatable",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.planner import PlanRequest, plan_recipe
    from areal_hex_plugin.planner.report import describe_plan
    from areal_hex_plugin.specs.config import ObjectiveConfig
    from areal_hex_plugin.specs.typed import meta_of, scalar

    for flag, value, name in (
        ("--budget", args.budget, "budget_per_hour"),
        ("--target-tokens-per-s", args.target_tokens_per_s, "target_tokens_per_s"),
    ):
        if value is not None:  # the same range as the recipe's hex.objective field
            scalar(float, value, flag, meta_of(ObjectiveConfig, name))
    if args.steps is not None and not 1 <= args.steps <= 10_000_000:
        from areal_hex_plugin.errors import HexError

        raise HexError("--steps", f"must be between 1 and 10,000,000, got {args.steps}", "give a step count")
    from areal_hex_plugin.commands.export import job_options

    if args.as_written:
        _check_no_search(args)

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        check_writable(path, flag)  # before solving, not after
    out = console(args.json, args.plot)
    recipe = load_recipe_from_args(args)
    options = job_options(args.export, args.job_python, args.accelerator_map, recipe)
    if args.exhaustive:
        check_exhaustive_depth(recipe)
    request = PlanRequest(
        exhaustive=args.exhaustive,
        budget_per_hour=args.budget,
        target_tokens_per_s=args.target_tokens_per_s,
        pareto=args.pareto or bool(args.plot),
        sensitivity=True,
    )
    if args.as_written:
        from areal_hex_plugin.planner.recipe_planner import plan_as_written

        with working(f"scoring {args.recipe} as written"):
            plan = plan_as_written(recipe, request)
        print(describe_plan(plan, out, args.steps), file=out)
        return _write(args, plan, recipe, options, out)
    with working(f"planning {args.recipe}" + (" and its cost frontier" if request.pareto else "")):
        plan = plan_recipe(recipe, request)
    print(describe_plan(plan, out, args.steps), file=out)
    if args.unconstrained:
        from dataclasses import replace

        from areal_hex_plugin.planner.caps import PAPER, recipe_caps
        from areal_hex_plugin.planner.report import describe_runtime_gap

        with working(f"planning {args.recipe} in the paper's unconstrained space"):
            paper = plan_recipe(recipe, replace(request, caps=PAPER, sensitivity=False))
        print("\n" + describe_runtime_gap(plan, paper, recipe_caps(recipe), out), file=out)
    return _write(args, plan, recipe, options, out)


def _write(args: argparse.Namespace, plan, recipe, options, out) -> int:
    """Write ``plan`` where ``--json``, ``--plot`` and ``--export`` ask for it."""
    from areal_hex_plugin.planner.report import plot_frontier

    if args.json:
        print(f"\nplan written to {plan.save(args.json)}", file=out)
    if args.plot:
        print(f"frontier plotted to {plot_frontier(plan, args.plot)}", file=out)
    if args.export:
        _export(args, plan, recipe, options, out)
    return 0


def _export(args: argparse.Namespace, plan, recipe, options, out) -> None:
    """``--export``: the job, with the overrides and the objective flags the plan was made with."""
    from areal_hex_plugin.commands.export import export

    overrides = list(args.overrides)
    if args.budget is not None:
        overrides.append(f"hex.objective.budget_per_hour={args.budget:g}")
    if args.target_tokens_per_s is not None:
        overrides.append(f"hex.objective.target_tokens_per_s={args.target_tokens_per_s:g}")
    kind, where = args.export
    job, plan_path = export(kind, where, plan, recipe, args.recipe, overrides, options)
    submit = {
        "slurm": f"sbatch {job}",
        "ray": f"python -c 'import json, ray.job_submission as j; "
        f'j.JobSubmissionClient().submit_job(**json.load(open("{job}")))\'',
        "skypilot": f"sky jobs launch {job} --secret AREAL_HEX_TRANSPORT_TOKEN",
    }[kind]
    print(f"{kind} job written to {job} (plan {plan_path}); submit it with: {submit}", file=out)


def _check_no_search(args: argparse.Namespace) -> None:
    """``--as-written`` scores one allocation: the flags that search or sweep are refused beside it."""
    from areal_hex_plugin.errors import HexError

    for flag, given in (
        ("--exhaustive", args.exhaustive),
        ("--pareto", args.pareto),
        ("--plot", args.plot),
        ("--unconstrained", args.unconstrained),
    ):
        if given:
            raise HexError(
                flag,
                "searches plans; --as-written scores the recipe's own allocation with no search",
                f"drop {flag} or --as-written (a plan without --as-written shows the allocation as written beside it)",
            )


def check_exhaustive_depth(recipe) -> None:
    """The brute force enumerates pipelines of a bounded depth (``planner/brute.py``); a recipe allowing deeper
    ones (``hex.solver.max_pp_stages``, by default as deep as the model allows) is refused with the bound to set."""
    from areal_hex_plugin.errors import HexError
    from areal_hex_plugin.planner.brute import LIMITS

    limit, depth = LIMITS["hex.solver.max_pp_stages"], recipe.solver.max_pp_stages
    if depth <= limit:
        return
    explicit = recipe.hex.solver.max_pp_stages is not None
    why = "as set" if explicit else f"unset: as deep as {recipe.workload.model.name}'s {depth} layers allow"
    raise HexError(
        "--exhaustive",
        f"exhaustive mode enumerates pipelines of at most {limit} stages; hex.solver.max_pp_stages is {depth} "
        f"({why})",
        f"append hex.solver.max_pp_stages={limit} to the command to prove the optimum among pipelines of at most "
        f"{limit} stages, or drop --exhaustive",
    )
