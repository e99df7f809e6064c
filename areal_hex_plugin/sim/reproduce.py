"""The paper's experiments (arXiv 2511.00796 §4.5-4.8) re-run through our planner and simulator.

Every plan comes from the planner on the paper's recipes (``recipes/paper/*.yaml``: the paper's GPUs, links and
prices) and is simulated for 30 steps; the figure reported is the simulated steady-state tokens per second of
wall time, i.e. tokens / (weight sync + max(rollout incl. reward, train)) as the paper measures it. Nothing is
tuned toward the paper's numbers.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import IO

from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.scheduler import PlanRequest, plan_recipe
from areal_hex_plugin.scheduler.caps import PAPER
from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.sim.result import SimResult
from areal_hex_plugin.specs.recipe import Recipe, load_recipe
from areal_hex_plugin.tables import render_table

SCHEMA_VERSION = 1  # of the JSON document (areal_hex_plugin/schemas/reproduce.schema.json)
MODELS = {"1.5B": "1.5b.yaml", "7B": "7b.yaml", "14B": "14b.yaml"}
EQUAL_BUDGET = 126.72  # 24 H800 at $5.28/h
STEPS = 30
# Machines (8 GPUs each) of (H800, H20) per experiment.
# The paper's 56-GPU heterogeneous cluster: with 8-GPU machines no H800 + H20 mix of 56 GPUs fits $126.72/h, so
# the equal-budget plan picks its machines within the budget, and this run shows the 56-GPU cluster beside it.
HEX_56 = (1, 6)  # 8 H800 + 48 H20 = $131.04/h
EQUAL_THROUGHPUT_HEX = (1, 3)  # 8 H800 + 24 H20 = $86.64/h
EQUAL_THROUGHPUT_H800 = (3, 0)  # 24 H800 = $126.72/h
ABLATION = (3, 0)
SCHEDULER_SIZES = {24: (1, 2), 32: (1, 3), 40: (2, 3), 56: (1, 6)}


@dataclasses.dataclass(frozen=True)
class Run:
    plan: HexPlan
    result: SimResult

    @property
    def tokens_per_s(self) -> float:
        return self.result.tokens_per_s

    @property
    def gpus(self) -> dict[str, int]:
        gpus: dict[str, int] = {}
        for part in (self.plan.train.gpus, self.plan.rollout.gpus):
            for name, n in part.items():
                gpus[name] = gpus.get(name, 0) + n
        return gpus


def with_machines(recipe: Recipe, machines: tuple[int, int]) -> Recipe:
    """The recipe on ``machines`` = (H800 machines, H20 machines); pools without machines are dropped."""
    counts = dict(zip(("H800-PCIe", "H20"), machines, strict=True))
    pools = tuple(
        dataclasses.replace(p, machines=counts[p.gpu_type])
        for p in recipe.cluster.pools
        if counts[p.gpu_type]
    )
    return dataclasses.replace(recipe, cluster=dataclasses.replace(recipe.cluster, pools=pools))


def only(recipe: Recipe, gpu_type: str) -> Recipe:
    pools = tuple(p for p in recipe.cluster.pools if p.gpu_type == gpu_type)
    return dataclasses.replace(recipe, cluster=dataclasses.replace(recipe.cluster, pools=pools))


def run(recipe: Recipe, budget: float | None = None, shares: str = "plan", timeline: bool = False) -> Run:
    plan = plan_recipe(recipe, PlanRequest(budget_per_hour=budget, caps=PAPER))
    spec = sim_spec(recipe, plan)
    if shares == "uniform":
        # The paper's ablation: every replica gets the same number of samples, whatever its speed.
        replicas = sum(lane.count for lane in spec.lanes)
        spec = dataclasses.replace(
            spec, lanes=tuple(dataclasses.replace(lane, share=lane.count / replicas) for lane in spec.lanes)
        )
    return Run(plan, simulate(spec, steps=STEPS, seed=0, timeline=timeline))


def run_whole(recipe: Recipe, timeline: bool) -> Run:
    """The best plan when every machine of ``recipe`` may be rented (its budget is the inventory's price)."""
    return run(recipe, recipe.cluster.price_per_hour, timeline=timeline)


def reproduce(recipes_dir: Path, progress=print, timeline: bool = False) -> tuple[dict, dict[str, Run]]:
    """All experiments: the JSON the issue lists, and the runs by name (with timelines on request)."""
    out: dict = {
        "schema_version": SCHEMA_VERSION,
        "equal_budget": {},
        "equal_throughput": {},
        "ablation": {},
        "scheduler_time_s": {},
        "plans": {},
    }
    runs: dict[str, Run] = {}
    recipes = {name: load_recipe(recipes_dir / file, []) for name, file in MODELS.items()}
    for name, recipe in recipes.items():
        progress(f"{name}: equal budget")
        hex_run = run(recipe, EQUAL_BUDGET, timeline=timeline)
        h800 = run(only(recipe, "H800-PCIe"), EQUAL_BUDGET, timeline=timeline)
        h20 = run(only(recipe, "H20"), EQUAL_BUDGET, timeline=timeline)
        hex_56 = run_whole(with_machines(recipe, HEX_56), timeline)
        out["equal_budget"][name] = {
            "hex_tokens_per_s": hex_run.tokens_per_s,
            "h800_tokens_per_s": h800.tokens_per_s,
            "h20_tokens_per_s": h20.tokens_per_s,
            "hex_56_gpus_tokens_per_s": hex_56.tokens_per_s,
            "hex_56_gpus_cost_per_hour": hex_56.plan.predicted.cost_per_hour,
        }
        progress(f"{name}: equal throughput")
        small_hex = run_whole(with_machines(recipe, EQUAL_THROUGHPUT_HEX), timeline)
        h800_24 = run_whole(with_machines(recipe, EQUAL_THROUGHPUT_H800), timeline)
        out["equal_throughput"][name] = {
            "hex_tokens_per_s": small_hex.tokens_per_s,
            "hex_cost_per_hour": small_hex.plan.predicted.cost_per_hour,
            "h800_tokens_per_s": h800_24.tokens_per_s,
            "h800_cost_per_hour": h800_24.plan.predicted.cost_per_hour,
        }
        progress(f"{name}: ablation")
        ablation = with_machines(recipe, ABLATION)
        optimized = run_whole(ablation, timeline)
        uniform = run(ablation, ablation.cluster.price_per_hour, shares="uniform")
        out["ablation"][name] = {
            "uniform_tokens_per_s": uniform.tokens_per_s,
            "optimized_tokens_per_s": optimized.tokens_per_s,
        }
        named = {
            "equal_budget.hex": hex_run,
            "equal_budget.h800": h800,
            "equal_budget.h20": h20,
            "equal_budget.hex_56_gpus": hex_56,
            "equal_throughput.hex": small_hex,
            "equal_throughput.h800": h800_24,
            "ablation.optimized": optimized,
        }
        for key, r in named.items():
            runs[f"{name}.{key}"] = r
            out["plans"][f"{name}.{key}"] = {
                "gpus": r.gpus,
                "cost_per_hour": r.plan.predicted.cost_per_hour,
                "predicted_tokens_per_s": r.plan.predicted.tokens_per_s,
                "simulated_tokens_per_s": r.tokens_per_s,
                "simulated_step_s": r.result.step_time_s,
            }
    base = recipes["7B"]
    for size, machines in SCHEDULER_SIZES.items():
        progress(f"scheduler time: {size} GPUs")
        start = time.perf_counter()
        mix = with_machines(base, machines)
        plan_recipe(mix, PlanRequest(budget_per_hour=mix.cluster.price_per_hour, caps=PAPER))
        out["scheduler_time_s"][str(size)] = time.perf_counter() - start
    return out, runs


def tables(out: dict, stream: IO[str] | None = None) -> str:
    """The paper-style tables (rich on a terminal ``stream``, plain text otherwise)."""

    def table(headers: list[str], rows: list[list]) -> str:
        return render_table(headers, rows, right=headers[1:], stream=stream)

    budget = out["equal_budget"]
    lines = ["Equal budget ($126.72/h): tokens/s (simulated, 30 steps)"]
    rows = []
    for name, row in budget.items():
        h800, h20, hx = row["h800_tokens_per_s"], row["h20_tokens_per_s"], row["hex_tokens_per_s"]
        rows.append([name, f"{h800:,.0f}", f"{h20:,.0f}", f"{hx:,.0f}", _ratio(hx, h800), _ratio(hx, h20)])
    lines.append(table(["model", "AReaL H800", "AReaL H20", "AReaL-Hex", "Hex/H800", "Hex/H20"], rows))
    lines += [
        "",
        "The 56-GPU heterogeneous cluster (8 H800 + 48 H20, $131.04/h: no 56-GPU mix of 8-GPU machines fits the budget)",
        table(
            ["model", "tokens/s", "$/h"],
            [
                [n, f"{r['hex_56_gpus_tokens_per_s']:,.0f}", f"{r['hex_56_gpus_cost_per_hour']:.2f}"]
                for n, r in budget.items()
            ],
        ),
        "",
        "Equal throughput: 8 H800 + 24 H20 vs 24 H800",
    ]
    rows = []
    for name, row in out["equal_throughput"].items():
        hex_cost = row["hex_cost_per_hour"] / max(row["hex_tokens_per_s"], 1e-9)
        h800_cost = row["h800_cost_per_hour"] / max(row["h800_tokens_per_s"], 1e-9)
        rows.append(
            [name, f"{row['hex_tokens_per_s']:,.0f}", f"{row['hex_cost_per_hour']:.2f}",
             f"{row['h800_tokens_per_s']:,.0f}", f"{row['h800_cost_per_hour']:.2f}", _ratio(h800_cost, hex_cost)]
        )  # fmt: skip
    lines.append(table(["model", "Hex t/s", "Hex $/h", "H800 t/s", "H800 $/h", "cost ratio"], rows))
    lines += ["", "Ablation on 24 H800: samples split uniformly vs by the plan's shares"]
    rows = [
        [name, f"{r['uniform_tokens_per_s']:,.0f}", f"{r['optimized_tokens_per_s']:,.0f}",
         _ratio(r["optimized_tokens_per_s"], r["uniform_tokens_per_s"])]
        for name, r in out["ablation"].items()
    ]  # fmt: skip
    lines += [table(["model", "uniform", "optimised", "gain"], rows), ""]
    rows = [
        [key, " + ".join(f"{n} {t}" for t, n in sorted(r["gpus"].items())), f"{r['cost_per_hour']:.2f}",
         f"{r['predicted_tokens_per_s']:,.0f}", f"{r['simulated_tokens_per_s']:,.0f}"]
        for key, r in out["plans"].items()
    ]  # fmt: skip
    lines.append(table(["every plan", "GPUs used", "$/h", "planner t/s", "simulated t/s"], rows))
    lines += [
        "",
        "Scheduler time (7B): "
        + ", ".join(f"{n} GPUs {t:.2f} s" for n, t in out["scheduler_time_s"].items()),
    ]
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"
