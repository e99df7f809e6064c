"""Scheduler benchmark: solve time by cluster size, and two-phase vs exhaustive optimality on small clusters.

    .venv/bin/python benchmarks/scheduler.py --json OUT [--quick]

Prints (and writes) JSON: ``sizes.<N>.solve_time_s`` for N = 24, 32, 40, 56 (H800-PCIe + H20, the paper's
Table 5 sizes), 256 and 1024 (four types) and 4096 (six types); ``optimality``: random clusters of at most 32
GPUs and 2-3 types, each with the two-phase and the exhaustive tokens/s (both at the same delta window, each
split scored by its own search's phase 1). Everything is seeded; the clusters are written as recipe overrides of
``recipes/paper/*.yaml`` so they go through the same reader as a user's recipe.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from report import emit  # benchmarks/report.py, beside this script

from areal_hex_plugin.scheduler.caps import PAPER
from areal_hex_plugin.scheduler.planner import Planner, PlanRequest
from areal_hex_plugin.specs.recipe import cheapest_deployment, load_recipe

ROOT = Path(__file__).resolve().parent.parent
# (GPU type, price per GPU-hour): the paper's relative prices where it has them, the same scale otherwise.
GPUS = {
    "H800-PCIe": 5.28,
    "H20": 1.85,
    "A100-80GB": 2.26,
    "L40S": 1.08,
    "H100": 6.0,
    "H200": 7.5,
}
# Machines per pool for each benchmark size (8 GPUs per machine).
SIZES: dict[int, dict[str, int]] = {
    24: {"H800-PCIe": 1, "H20": 2},
    32: {"H800-PCIe": 1, "H20": 3},
    40: {"H800-PCIe": 2, "H20": 3},
    56: {"H800-PCIe": 1, "H20": 6},
    256: {"H800-PCIe": 8, "H20": 8, "A100-80GB": 8, "L40S": 8},
    1024: {"H800-PCIe": 32, "H20": 32, "A100-80GB": 32, "L40S": 32},
    4096: {"H100": 86, "H800-PCIe": 86, "H20": 85, "A100-80GB": 85, "L40S": 85, "H200": 85},
}


# Sizes up to this many GPUs are also solved exhaustively.
EXHAUSTIVE_SIZES = 56


def pools_override(pools: list[dict]) -> str:
    items = []
    for i, p in enumerate(pools):
        items.append(
            f"{{name: p{i}, gpu_type: {p['gpu_type']}, gpus_per_machine: {p['gpus_per_machine']}, "
            f"machines: {p['machines']}, price_per_gpu_hour: {GPUS[p['gpu_type']]}, inter_machine_gb_per_s: 5.0}}"
        )
    return "hex.cluster.pools=[" + ", ".join(items) + "]"


def recipe_for(model: str, pools: list[dict], time_limit_s: float, budget: float | None = None):
    overrides = [
        pools_override(pools),
        f"hex.objective.budget_per_hour={'null' if budget is None else budget}",
        f"hex.solver.time_limit_s={time_limit_s}",
    ]
    return load_recipe(ROOT / "recipes" / "paper" / f"{model}.yaml", overrides)


def bench_size(n: int, time_limit_s: float) -> dict:
    pools = [{"gpu_type": t, "gpus_per_machine": 8, "machines": m} for t, m in SIZES[n].items()]
    recipe = recipe_for("7b", pools, time_limit_s)
    start = time.monotonic()
    planner = Planner(recipe, PlanRequest(caps=PAPER))
    result = planner.search(planner.limits, None)
    elapsed = time.monotonic() - start
    best = result.best
    row = {
        "gpus": sum(8 * m for m in SIZES[n].values()),
        "gpu_types": list(SIZES[n]),
        "solve_time_s": round(elapsed, 3),
        "status": result.status,
        "iterations": result.iterations,
        "tokens_per_s": round(planner.tokens_per_s(best), 1),
        "cost_per_hour": round(best.cost_per_hour, 2) if best else None,
        "split": {"train": list(best.split.train), "rollout": list(best.split.rollout)} if best else None,
    }
    if n <= EXHAUSTIVE_SIZES:
        # The paper's Table 5 compares against exhaustive search on these sizes: do the same.
        start = time.monotonic()
        full = Planner(recipe, PlanRequest(exhaustive=True, caps=PAPER))
        optimum = full.search(full.limits, None)
        row["exhaustive_solve_time_s"] = round(time.monotonic() - start, 3)
        window = max(result.window, optimum.window)
        row["exhaustive_tokens_per_s"] = round(
            full.tokens_per_s(full.ev.evaluate(optimum.best.split, window)), 1
        )
        row["tokens_per_s_same_window"] = round(
            planner.tokens_per_s(planner.ev.evaluate(best.split, window)), 1
        )
    return row


def random_cluster(rng: random.Random) -> list[dict]:
    types = rng.sample(sorted(GPUS), rng.choice((2, 3)))
    pools, budget_gpus = [], 32
    for i, gpu_type in enumerate(types):
        per_machine = rng.choice((2, 4, 8))
        room = (budget_gpus - 2 * (len(types) - i - 1)) // per_machine
        while room < 1:
            per_machine //= 2
            room = (budget_gpus - 2 * (len(types) - i - 1)) // per_machine
        machines = rng.randint(1, min(room, 6))
        pools.append({"gpu_type": gpu_type, "gpus_per_machine": per_machine, "machines": machines})
        budget_gpus -= per_machine * machines
    return pools


def compare(pools: list[dict], budget_fraction: float | None, time_limit_s: float) -> dict:
    probe = recipe_for("1.5b", pools, time_limit_s)
    budget = None
    if budget_fraction:
        # Never below the cheapest trainer + rollout deployment (the recipe reader refuses such a budget).
        cheapest = cheapest_deployment(probe.cluster, probe.workload)[0]
        budget = round(max(probe.cluster.price_per_hour * budget_fraction, cheapest), 2)
    recipe = recipe_for("1.5b", pools, time_limit_s, budget)
    fast = Planner(recipe, PlanRequest(caps=PAPER))
    start = time.monotonic()
    two = fast.search(fast.limits, budget)
    two_s = time.monotonic() - start
    full = Planner(recipe, PlanRequest(exhaustive=True, caps=PAPER))
    start = time.monotonic()
    ex = full.search(full.limits, budget)
    ex_s = time.monotonic() - start
    window = max(two.window, ex.window)
    two_rate = fast.tokens_per_s(fast.ev.evaluate(two.best.split, window)) if two.best else 0.0
    ex_rate = full.tokens_per_s(full.ev.evaluate(ex.best.split, window)) if ex.best else 0.0
    return {
        "pools": [f"{p['machines']}x{p['gpus_per_machine']} {p['gpu_type']}" for p in pools],
        "gpus": recipe.cluster.n_gpus,
        "budget_per_hour": budget,
        "two_phase": round(two_rate, 1),
        "exhaustive": round(ex_rate, 1),
        "ratio": round(two_rate / ex_rate, 6) if ex_rate else None,
        "two_phase_s": round(two_s, 3),
        "exhaustive_s": round(ex_s, 3),
        "exhaustive_splits": ex.iterations,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="sizes up to 56 GPUs and 6 small clusters only")
    parser.add_argument("--clusters", type=int, default=24, help="random small clusters to compare (>= 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    args = parser.parse_args(argv)

    sizes = [n for n in SIZES if not args.quick or n <= 56]
    report: dict = {"sizes": {}, "optimality": []}
    for n in sizes:
        report["sizes"][str(n)] = bench_size(n, args.time_limit_s)
        print(f"size {n}: {report['sizes'][str(n)]['solve_time_s']}s", file=sys.stderr)
    rng = random.Random(args.seed)
    for i in range(6 if args.quick else args.clusters):
        pools = random_cluster(rng)
        fraction = None if i % 2 == 0 else rng.choice((0.5, 0.7))
        row = compare(pools, fraction, args.time_limit_s)
        report["optimality"].append(row)
        print(f"cluster {i}: {row['pools']} ratio {row['ratio']}", file=sys.stderr)
    ratios = [r["ratio"] for r in report["optimality"] if r["ratio"] is not None]
    report["summary"] = {
        "clusters": len(report["optimality"]),
        "min_ratio": min(ratios) if ratios else None,
        "within_1_percent": sum(r >= 0.99 for r in ratios),
        "goal_56_under_1s": report["sizes"].get("56", {}).get("solve_time_s", 1e9) < 1.0,
        "goal_1024_under_30s": report["sizes"].get("1024", {}).get("solve_time_s", 1e9) < 30.0
        if "1024" in report["sizes"]
        else None,
    }
    emit(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
