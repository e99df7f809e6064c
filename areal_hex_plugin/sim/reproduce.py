"""The paper's experiments (arXiv 2511.00796 §4.5-4.8) re-run through our planner and simulator on its testbed.

The testbed is rented by the GPU as the paper does (``specs/rental.py``: whole 8-GPU machines plus one machine
holding the rest): AReaL on 24 H800 or on 68 H20 (what $126.72/h buys), AReaL-Hex on 56 GPUs within $126.72/h (the
H800/H20 mix is the paper's to choose, so every 56-GPU mix the budget allows is planned and the best kept), the
equal-throughput cluster of 8 H800 + 24 H20 ($86.64/h) and mixed clusters of 24, 32, 40 and 56 GPUs. AReaL's
baselines run upstream's weight transport; AReaL-Hex runs the recipe's. Two more equal-budget runs say where a
gain would come from: the 24 H800 run as the paper's AReaL baselines were (:func:`as_areal_ran`, the calibration's
measured setting), and the 56-GPU mixes planned with the paper's layouts (``caps.PAPER``: training pipeline
stages of any dp and tp, types mixed across them, which upstream's engines do not run). Every plan is simulated
for 30 steps; the tokens/s reported are the simulated steady state, tokens / (weight sync + max(rollout incl.
reward, train)) as the paper measures it, and the phases are the planner's.

The cost model's factors are the paper calibration (``builtin:paper``), fitted to AReaL's *homogeneous* runs only
(``planner/fit_baselines.py``); every mixed-cluster figure here is a prediction.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import IO

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner import PlanRequest, plan_recipe
from areal_hex_plugin.planner.caps import PAPER, RuntimeCaps, recipe_caps
from areal_hex_plugin.planner.evaluate import Evaluator
from areal_hex_plugin.planner.fit_baselines import areal_runtime, as_measured, measured_eta, setting_from
from areal_hex_plugin.planner.inflight import choose, replica_stages, serial_rollout_s
from areal_hex_plugin.planner.rollout_model import solve_rollout
from areal_hex_plugin.planner.sensitivity import WORKLOAD, Held, Rules, elasticities, inputs, model
from areal_hex_plugin.planner.train_search import search_train
from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.sim.result import SimResult
from areal_hex_plugin.specs.files import read_json
from areal_hex_plugin.specs.recipe import Recipe, load_recipe
from areal_hex_plugin.specs.rental import rent
from areal_hex_plugin.tables import render_table

SCHEMA_VERSION = 4  # of the JSON document (areal_hex_plugin/schemas/reproduce.schema.json)
MODELS = {"1.5B": "1.5b.yaml", "7B": "7b.yaml", "14B": "14b.yaml"}
EQUAL_BUDGET = 126.72  # 24 H800 at $5.28/h
STEPS = 30
H800, H20 = "H800-PCIe", "H20"
PRICES = {H800: 5.28, H20: 1.85}
BASELINE_GPUS = {H800: 24, H20: int(EQUAL_BUDGET // PRICES[H20])}  # 68 H20
HEX_GPUS = 56
EQUAL_THROUGHPUT_HEX = {H800: 8, H20: 24}  # $86.64/h, the paper's 32-GPU cluster
# The mixed clusters of Fig. 5 / Table 5 (compositions not stated; 32 is Table 4's, 56 the equal-budget one).
SIZES = {24: {H800: 8, H20: 16}, 32: EQUAL_THROUGHPUT_HEX, 40: {H800: 16, H20: 24}}


Planned = tuple[HexPlan, Recipe]  # a plan and the recipe it was planned on


@dataclasses.dataclass(frozen=True)
class Run:
    plan: HexPlan
    result: SimResult
    recipe: Recipe  # the recipe planned (on its rented cluster)

    @property
    def planned(self) -> Planned:
        return self.plan, self.recipe

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

    @property
    def phases(self) -> dict[str, float]:
        p = self.plan.predicted
        return {"rollout_s": p.rollout_time_s, "train_s": p.train_time_s, "weight_sync_s": p.weight_sync_s}


def rented(recipe: Recipe, gpus: dict[str, int], transport: str | None = None) -> Recipe:
    """``recipe`` on ``gpus`` (GPU type -> count) rented by the GPU; ``transport`` replaces hex.transport."""
    hex_cfg = recipe.hex if transport is None else dataclasses.replace(recipe.hex, transport=transport)
    return dataclasses.replace(recipe, cluster=rent(recipe.cluster, gpus), hex=hex_cfg)


def paper_request(
    recipe: Recipe, budget: float | None = None, caps: RuntimeCaps | None = None
) -> PlanRequest:
    """The plan request of the paper's setting: within ``budget`` (else the whole testbed's price), every machine
    in one role (the paper splits its testbed by machines, D_T / D_I; the planner may split a machine of a small
    inventory between the roles, which this leaves out), in the recipe's runtime (or ``caps``), spending the budget
    (``pick: fastest``: the paper's runs and its equal-budget comparisons spend theirs)."""
    caps = dataclasses.replace(caps or recipe_caps(recipe), split_machines=False)
    return PlanRequest(budget_per_hour=budget or recipe.cluster.price_per_hour, caps=caps, pick="fastest")


def run(
    recipe: Recipe, budget: float | None = None, timeline: bool = False, caps: RuntimeCaps | None = None
) -> Run:
    return simulated(plan_recipe(recipe, paper_request(recipe, budget, caps)), recipe, timeline)


def simulated(plan: HexPlan, recipe: Recipe, timeline: bool) -> Run:
    """``plan`` (of ``recipe``) simulated for :data:`STEPS` steps."""
    return Run(plan, simulate(sim_spec(recipe, plan), steps=STEPS, seed=0, timeline=timeline), recipe)


def best_mix(
    recipe: Recipe, gpus: int, budget: float, timeline: bool, caps: RuntimeCaps | None = None
) -> Run:
    """The best plan over the H800 + H20 mixes of ``gpus`` GPUs that ``budget`` can rent (at least one of each),
    simulated (the others are not: the choice is by the plans' predictions)."""
    plans = []
    for h800 in range(1, gpus):
        mix = {H800: h800, H20: gpus - h800}
        if sum(n * PRICES[t] for t, n in mix.items()) <= budget + 1e-9:
            on = rented(recipe, mix)
            plans.append((plan_recipe(on, paper_request(on, budget, caps)), on))
    plan, on = max(plans, key=lambda p: p[0].predicted.tokens_per_s)
    return simulated(plan, on, timeline)


def as_areal_ran(recipe: Recipe, layout: list[int] | None = None, eta: int | None = None) -> Recipe:
    """``recipe`` run as the paper's AReaL baselines were (the calibration's measured setting,
    ``fit_baselines.areal_runtime``): one batch of rollouts admitted, weights every step, the staleness bound
    ``eta`` (None: the shipped paper profile's), replicas of ``layout`` ([tp, pp]; None: the recipe's),
    upstream's weight transport."""
    solver = dataclasses.replace(recipe.hex.solver, max_update_window=1)
    if layout:
        solver = dataclasses.replace(solver, rollout_layout=list(layout))
    eta = measured_eta(recipe.workload.model.name) if eta is None else eta
    workload = dataclasses.replace(recipe.workload, rl=areal_runtime(recipe.workload.rl, eta))
    hex_cfg = dataclasses.replace(recipe.hex, solver=solver, transport="upstream")
    return dataclasses.replace(recipe, workload=workload, hex=hex_cfg)


def even_split(recipe: Recipe) -> dict[str, float]:
    """The paper's ablation "AReaL (u)": the GPUs split evenly between rollout and training (12 + 12 of 24 H800),
    each half laid out as the planner would for the recipe's runtime (phase 1a and 1b), at the paper's metric."""
    pool = recipe.cluster.pools[0]
    half = pool.n_gpus // 2
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    solver, caps = recipe.solver, recipe_caps(recipe)
    train = search_train(cm, recipe.cluster, {pool.name: half}, caps.train_stages(solver.max_pp_stages))
    evaluator = Evaluator(cm, recipe.cluster, recipe.workload, solver, "broadcast", caps=caps)
    configs = evaluator.replica_configs(pool.name)
    if caps.one_rollout_layout or caps.one_layout_per_pool:
        fleet = max((solve_rollout([c], half) for c in configs), key=lambda f: f.tokens_per_s)
    else:
        fleet = solve_rollout(configs, half)
    replicas = [(replica_stages(c), y) for c, y in fleet.counts]
    sync = cm.weight_sync(cm.senders(train.stages), replicas, "broadcast").seconds
    # Weights every step, the in-flight caps as the planner chooses them.
    reward_s = cm.reward_s(recipe.workload.rl.samples_per_step)
    runtimes = [r for r in evaluator.inflight.runtimes(fleet.counts, reward_s) if r.window == 1]
    runtime = choose(runtimes, train.step_time_s, sync)
    return {
        "tokens_per_s": recipe.workload.tokens_per_step / runtime.step_s(train.step_time_s, sync),
        "rollout_s": serial_rollout_s(runtime, train.step_time_s),
        "train_s": train.step_time_s,
        "weight_sync_s": sync,
    }


def reproduce(recipes_dir: Path, progress=print, timeline: bool = False) -> tuple[dict, dict[str, Run]]:
    """All experiments: the JSON the issue lists, and the runs by name (with timelines on request)."""
    out: dict = {
        "schema_version": SCHEMA_VERSION,
        "as_measured": {},
        "equal_budget": {},
        "equal_throughput": {},
        "ablation": {},
        "scheduler_time_s": {},
        "plans": {},
        "phases": {},
        "per_dollar": {},
        "elasticity": {},
    }
    runs: dict[str, Run] = {}
    recipes = {name: load_recipe(recipes_dir / file, []) for name, file in MODELS.items()}
    measured = read_json(recipes_dir / "baselines.json", "baselines", "give the paper's baselines file")
    for name, recipe in recipes.items():
        progress(f"{name}: the paper's AReaL runs as measured")
        out["as_measured"][name] = as_measured(setting_from(recipe), recipe.calibration, measured)
        progress(f"{name}: equal budget")
        h800 = run(rented(recipe, {H800: BASELINE_GPUS[H800]}, "upstream"), EQUAL_BUDGET, timeline)
        h20 = run(rented(recipe, {H20: BASELINE_GPUS[H20]}, "upstream"), EQUAL_BUDGET, timeline)
        hex_run = best_mix(recipe, HEX_GPUS, EQUAL_BUDGET, timeline)
        areal = run(as_areal_ran(rented(recipe, {H800: BASELINE_GPUS[H800]}), [1, 1]), EQUAL_BUDGET, timeline)
        hex_paper = best_mix(recipe, HEX_GPUS, EQUAL_BUDGET, timeline, PAPER)
        out["equal_budget"][name] = {
            "hex_tokens_per_s": hex_run.tokens_per_s,
            "h800_tokens_per_s": h800.tokens_per_s,
            "h20_tokens_per_s": h20.tokens_per_s,
            "hex_56_gpus_tokens_per_s": hex_run.tokens_per_s,
            "hex_56_gpus_cost_per_hour": hex_run.plan.predicted.cost_per_hour,
            "h800_areal_runtime_tokens_per_s": areal.tokens_per_s,
            "hex_paper_layouts_tokens_per_s": hex_paper.tokens_per_s,
            "h800_as_measured_tokens_per_s": out["as_measured"][name]["h800"]["tokens_per_s"],
            "h20_as_measured_tokens_per_s": out["as_measured"][name]["h20"]["tokens_per_s"],
        }
        progress(f"{name}: equal throughput")
        small_hex = run(rented(recipe, EQUAL_THROUGHPUT_HEX), timeline=timeline)
        out["equal_throughput"][name] = {
            "hex_tokens_per_s": small_hex.tokens_per_s,
            "hex_cost_per_hour": small_hex.plan.predicted.cost_per_hour,
            "h800_tokens_per_s": h800.tokens_per_s,
            "h800_cost_per_hour": h800.plan.predicted.cost_per_hour,
        }
        progress(f"{name}: ablation")
        uniform = even_split(rented(recipe, {H800: BASELINE_GPUS[H800]}, "upstream"))
        out["ablation"][name] = {
            "uniform_tokens_per_s": uniform["tokens_per_s"],
            "optimized_tokens_per_s": h800.plan.predicted.tokens_per_s,
        }
        progress(f"{name}: tokens/s per $/h by cluster size")
        # The 32-GPU cluster is the equal-throughput one, planned and simulated above.
        sized = {
            size: small_hex if mix == EQUAL_THROUGHPUT_HEX else run(rented(recipe, mix), timeline=timeline)
            for size, mix in SIZES.items()
        }
        sized[HEX_GPUS] = hex_run
        out["per_dollar"][name] = {
            str(size): r.plan.predicted.tokens_per_s / r.plan.predicted.cost_per_hour
            for size, r in sorted(sized.items())
        }
        progress(f"{name}: what the ratios hang on")
        out["elasticity"][name] = ratio_elasticities(
            recipe,
            {
                "equal_budget.hex_vs_h800": (hex_run.planned, h800.planned, False),
                "equal_budget.hex_vs_h20": (hex_run.planned, h20.planned, False),
                "equal_throughput.cost_ratio": (small_hex.planned, h800.planned, True),
            },
        )
        named = {
            "equal_budget.hex": hex_run,
            "equal_budget.h800": h800,
            "equal_budget.h20": h20,
            "equal_budget.h800_areal_runtime": areal,
            "equal_budget.hex_paper_layouts": hex_paper,
            "equal_throughput.hex": small_hex,
            **{f"size.{size}": r for size, r in sorted(sized.items()) if size != HEX_GPUS},
        }
        out["phases"][name] = {key: r.phases for key, r in named.items()}
        out["phases"][name]["ablation.uniform"] = {k: v for k, v in uniform.items() if k != "tokens_per_s"}
        for key, r in named.items():
            runs[f"{name}.{key}"] = r
            out["plans"][f"{name}.{key}"] = {
                "gpus": r.gpus,
                "cluster_gpus": _cluster_gpus(r),
                "cost_per_hour": r.plan.predicted.cost_per_hour,
                "predicted_tokens_per_s": r.plan.predicted.tokens_per_s,
                "simulated_tokens_per_s": r.tokens_per_s,
                "simulated_step_s": r.result.step_time_s,
                "tokens_per_s_per_dollar_hour": r.plan.predicted.tokens_per_s
                / r.plan.predicted.cost_per_hour,
            }
    base = recipes["7B"]
    for size, mix in {**SIZES, HEX_GPUS: {H800: 6, H20: 50}}.items():
        progress(f"scheduler time: {size} GPUs")
        start = time.perf_counter()
        plan_recipe(rented(base, mix), paper_request(rented(base, mix)))
        out["scheduler_time_s"][str(size)] = time.perf_counter() - start
    return out, runs


def ratio_elasticities(recipe: Recipe, pairs: dict[str, tuple[Planned, Planned, bool]]) -> dict[str, dict]:
    """Per ratio (name -> (Hex plan, baseline plan, whether per $/h), each with the recipe it was planned on): its
    predicted value, the Hex plan's tokens/s (per $/h) over the baseline's, and its elasticity to each factor of
    the testbed's GPU types and to the workload, every plan held (``planner/sensitivity.py``; a plan's $/h does
    not move, so a ratio per $/h moves as the ratio of tokens/s)."""
    calibration, workload = recipe.calibration, recipe.workload
    planned = list({id(p): p for a, b, _ in pairs.values() for p in (a, b)}.values())
    bases = {id(plan): CostModel(on.cluster, workload, calibration) for plan, on in planned}

    def measure(w, c) -> dict[str, float]:
        rates = {}
        for plan, on in planned:
            cm = model(bases[id(plan)], w, c)
            rates[id(plan)] = Held.of_plan(plan).tokens_per_s(cm, Rules.of(on))
        out = {}
        for key, ((a, _), (b, _), dollars) in pairs.items():
            costs = b.predicted.cost_per_hour / a.predicted.cost_per_hour if dollars else 1.0
            out[key] = rates[id(a)] / rates[id(b)] * costs if rates[id(b)] > 0 else 0.0
        return out

    found = elasticities(inputs(sorted(PRICES), workload, calibration), measure, workload, calibration)
    base = measure(workload, calibration)
    out = {}
    for key in pairs:
        entry: dict = {"predicted": base[key], "factors": {}, "workload": {}}
        for inp, e in found.items():
            value = None if e is None or e[key] is None else round(e[key], 4)
            group = entry["workload"] if inp.group == WORKLOAD else entry["factors"].setdefault(inp.group, {})
            group[inp.name] = value
        out[key] = entry
    return out


def _cluster_gpus(r: Run) -> dict[str, int]:
    """GPUs per type of the rented cluster the plan chose from (the plan may leave some idle)."""
    gpus: dict[str, int] = {}
    for m in r.plan.machines:
        gpus[m.gpu_type] = gpus.get(m.gpu_type, 0) + len(m.gpus)
    return gpus


def tables(out: dict, stream: IO[str] | None = None) -> str:
    """The paper-style tables (rich on a terminal ``stream``, plain text otherwise)."""

    def table(headers: list[str], rows: list[list]) -> str:
        return render_table(headers, rows, right=headers[1:], stream=stream)

    lines = [
        "The paper's AReaL runs as measured (their runtime, GPUs and split: the profile's measured setting), "
        "priced by the runtime and factors plan uses, beside the paper's figures"
    ]
    rows = []
    for name, per in out["as_measured"].items():
        for cluster, r in per.items():
            m = r["measured"]
            rows.append([f"{name} {cluster} ({r['gpus']} GPUs, eta {r['max_head_offpolicyness']})",
                         *(f"{r[k]:,.1f} / {m[k]:,.1f}" for k in ("rollout_s", "train_s", "weight_sync_s")),
                         f"{r['tokens_per_s']:,.0f} / {m['tokens_per_s']:,.0f}",
                         f"{r['tokens_per_s'] / m['tokens_per_s'] - 1:+.0%}"])  # fmt: skip
    headers = ["run", "rollout s (model / paper)", "train s", "weight sync s", "tokens/s", "tokens/s error"]
    lines += [table(headers, rows), ""]
    lines.append(
        "Equal budget ($126.72/h): tokens/s (simulated, 30 steps). Best homogeneous: 24 H800 / 68 H20 planned in "
        "the recipe's runtime; as measured: the paper's AReaL runs as they ran (above); AReaL's runtime on the "
        "plan's split: 24 H800, one batch admitted, weights every step; paper layouts: pipeline stages of any "
        "dp/tp across types, which upstream's engines do not run"
    )
    rows = []
    for name, row in out["equal_budget"].items():
        h800, h20, hx = row["h800_tokens_per_s"], row["h20_tokens_per_s"], row["hex_tokens_per_s"]
        areal, paper = row["h800_areal_runtime_tokens_per_s"], row["hex_paper_layouts_tokens_per_s"]
        as_h800, as_h20 = row["h800_as_measured_tokens_per_s"], row["h20_as_measured_tokens_per_s"]
        rows.append([name, f"{h800:,.0f}", f"{h20:,.0f}", f"{as_h800:,.0f}", f"{as_h20:,.0f}", f"{areal:,.0f}",
                     f"{hx:,.0f}", f"{row['hex_56_gpus_cost_per_hour']:.2f}", _ratio(hx, max(h800, h20)),
                     _ratio(hx, max(as_h800, as_h20)), _ratio(hx, areal), f"{paper:,.0f}"])  # fmt: skip
    headers = ["model", "best homog. 24 H800", "best homog. 68 H20", "as measured H800", "as measured H20",
               "AReaL's runtime", "Hex (56)", "Hex $/h", "Hex/best homog.", "Hex/as measured", "Hex/AReaL's",
               "paper layouts"]  # fmt: skip
    lines.append(table(headers, rows))
    lines += ["", "Equal throughput: 8 H800 + 24 H20 vs 24 H800"]
    rows = []
    for name, row in out["equal_throughput"].items():
        hex_cost = row["hex_cost_per_hour"] / max(row["hex_tokens_per_s"], 1e-9)
        h800_cost = row["h800_cost_per_hour"] / max(row["h800_tokens_per_s"], 1e-9)
        rows.append(
            [name, f"{row['hex_tokens_per_s']:,.0f}", f"{row['hex_cost_per_hour']:.2f}",
             f"{row['h800_tokens_per_s']:,.0f}", f"{row['h800_cost_per_hour']:.2f}", _ratio(h800_cost, hex_cost)]
        )  # fmt: skip
    lines.append(table(["model", "Hex t/s", "Hex $/h", "H800 t/s", "H800 $/h", "cost ratio"], rows))
    lines += [
        "",
        "Ablation on 24 H800: GPUs split evenly (12 + 12) vs the optimized split (planner, predicted)",
    ]
    rows = [
        [name, f"{r['uniform_tokens_per_s']:,.0f}", f"{r['optimized_tokens_per_s']:,.0f}",
         _ratio(r["optimized_tokens_per_s"], r["uniform_tokens_per_s"])]
        for name, r in out["ablation"].items()
    ]  # fmt: skip
    lines.append(table(["model", "uniform", "optimised", "gain"], rows))
    sizes = sorted({int(s) for row in out["per_dollar"].values() for s in row})
    lines += ["", "Mixed clusters: tokens/s per $/h by GPU count (planner)"]
    rows = [[name, *(f"{row[str(s)]:.1f}" for s in sizes)] for name, row in out["per_dollar"].items()]
    lines.append(table(["model", *(f"{s} GPUs" for s in sizes)], rows))
    lines += ["", "Seconds per step by phase (planner)"]
    rows = [
        [f"{name} {key}", f"{ph['rollout_s']:.1f}", f"{ph['train_s']:.1f}", f"{ph['weight_sync_s']:.1f}"]
        for name, per in out["phases"].items()
        for key, ph in per.items()
    ]
    lines += [table(["run", "rollout", "train", "weight sync"], rows), ""]
    rows = [
        [key, " + ".join(f"{n} {t}" for t, n in sorted(r["gpus"].items())),
         " + ".join(f"{n} {t}" for t, n in sorted(r["cluster_gpus"].items())), f"{r['cost_per_hour']:.2f}",
         f"{r['predicted_tokens_per_s']:,.0f}", f"{r['simulated_tokens_per_s']:,.0f}"]
        for key, r in out["plans"].items()
    ]  # fmt: skip
    lines.append(table(["every plan", "GPUs used", "of", "$/h", "planner t/s", "simulated t/s"], rows))
    lines += [
        "",
        "What the ratios hang on: d ln(ratio) / d ln(input) at +-5%, every plan held (--json: every input)",
    ]
    rows = [
        [f"{name} {key}", f"{entry['predicted']:.2f}", _largest(entry)]
        for name, per in out["elasticity"].items()
        for key, entry in per.items()
    ]
    lines.append(table(["ratio", "predicted", "largest elasticities"], rows))
    lines += [
        "",
        "Scheduler time (7B): "
        + ", ".join(f"{n} GPUs {t:.2f} s" for n, t in out["scheduler_time_s"].items()),
    ]
    return "\n".join(lines)


def _largest(entry: dict, shown: int = 3) -> str:
    values = [(f"{t} {k}", v) for t, per in entry["factors"].items() for k, v in per.items() if v is not None]
    values += [(k, v) for k, v in entry["workload"].items() if v is not None]
    return ", ".join(f"{name} {v:+.2f}" for name, v in sorted(values, key=lambda x: -abs(x[1]))[:shown])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and math.isfinite(a / b) else "-"
