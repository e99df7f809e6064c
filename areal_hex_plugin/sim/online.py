"""Plans that learn from the run, replayed (``simulate --truth PROFILE``): the simulator runs on the true factors
(the machines as they are) while the planner starts from the recipe's (as believed), with the online loop on.

Every ``every`` steps the loop refits the factors of the GPU types in play to what the simulated run measured
(``costmodel/refit.py``: each server's running requests and decode tokens/s, the train step's and a weight
update's seconds, the latter also per receiving pool as the true model gives it, sampled at every step's end; the first ``WARMUP_STEPS`` of a layout dropped, medians over the
last ``WINDOW_STEPS``; the recipe's calibration the prior), then decides (``planner/refit_replan.py``):

- the running layouts' shares re-solved under the refit model apply at once where they generate more than the
  threshold faster than the shares held (the router's shares change; a refit's noise moves none), as a live run's do
  (the threshold, as there, is the window's own uncertainty where its steps scatter more:
  ``refit_replan.change_threshold``);
- where the plan the refit model gives beats the running one by more than the threshold, its role and layout
  changes (or, on the same layouts, its update window, admission and in-flight caps) apply at the same step end
  as a re-plan and resume from a checkpoint taken there: the run restarts on the new plan, the rollouts in flight
  are dropped and the pipeline fills again (no relaunch time is charged).

The same steps are also played on the believed plan without the loop and on the plan the true factors give,
both on the true factors: the report gives per step tokens/s of all three, when the refit converged (the refit
after which no later one moves a factor by more than ``CONVERGED``) and the fraction of the gap between the
two recovered over the last ``LAST`` steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.costmodel.calibration import (
    RANGES,
    Calibration,
    read_profile,
    read_profile_sources,
    with_profile_figures,
)
from areal_hex_plugin.costmodel.refit import MeasurementWindow, ServerSample, StepSample, refit
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.planner.refit_replan import THRESHOLD, change_threshold, decide, plan_layout
from areal_hex_plugin.sim.engine import _Loop, simulate
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.sim.result import StepRecord

# Steps between refits (and re-plan decisions).
EVERY = 5
# A refit after which no later one moves any factor by more than this has converged.
CONVERGED = 0.05
# Steps at the end of the run the recovered gap is measured over (a step's tokens/s varies by 10-20%).
LAST = 10
# Factors that are costs: a type "30% better" has them 30% smaller.
COSTS = {"update_fixed_s", "decode_overhead_s"}


def factors_off(calibration: Calibration, gpu_type: str, change: float) -> Calibration:
    """``calibration`` with every factor of ``gpu_type`` ``change`` better (+) or worse (-), kept in its physical
    range: a truth for ``simulate --truth`` where a recipe believes ``calibration``."""
    eff = calibration.for_gpu(gpu_type)
    k = 1 + change
    factors = {
        f: min(max(getattr(eff, f) * (1 / k if f in COSTS else k), r.low), r.high) for f, r in RANGES.items()
    }
    return calibration.with_factors(gpu_type, factors, f"truth: {change:+.0%}")


def read_truth(path: str, recipe) -> Calibration:
    """The recipe's calibration with the factors and catalog figures (its ``gpu_catalog``: the machines' true
    figures where the recipe's ``hex.gpu_catalog`` declares others) of the profile at ``path`` (``--truth``:
    checked like any profile: finite, in range, known GPU types)."""
    sources = read_profile_sources(path, "--truth")
    truth = with_profile_figures(recipe.calibration, path, recipe.catalog, "--truth")
    for name, factors in read_profile(path, "--truth").items():
        canonical = recipe.catalog.get(name, f"--truth[{name}]").name
        for key, value in factors.items():
            truth = truth.with_factors(canonical, {key: value}, f"truth: {sources[(name, key)]}")
    return truth


class _Measured(_Loop):
    """The loop sampling every server's running requests and decode tokens/s at each step's end, and each
    update's seconds (per receiving pool: the true model's update to that pool's servers)."""

    def __init__(self, true_recipe, plan: HexPlan, seed: int, window: MeasurementWindow) -> None:
        super().__init__(sim_spec(true_recipe, plan), seed, False)
        self.shapes = [(g.pool, g.tp, g.pp) for g in plan.rollout.replicas]
        self.window = window
        layout = plan_layout(plan, true_recipe.hex.transport)
        cm = CostModel(true_recipe.cluster, true_recipe.workload, true_recipe.calibration)
        pools = sorted({s[0].pool for s, _ in layout.replicas} | set(layout.colocated))
        self.pool_sync = tuple((pool, layout.sync_s(cm, pool)) for pool in pools)

    def end_step(self, sync_s: float) -> None:
        super().end_step(sync_s)
        servers = []
        for replica in self.replicas:
            n = len(replica.running)
            if n:
                pool, tp, pp = self.shapes[replica.lane]
                servers.append(ServerSample(pool, tp, pp, n, n / replica.step_table[n]))
        pool_sync = self.pool_sync if sync_s else ()
        self.window.add(StepSample(tuple(servers), self.spec.train_s, sync_s or None, pool_sync))

    def route(self, shares: tuple[float, ...]) -> None:
        self.shares = list(shares)
        self.share_total = sum(shares)
        self.credit = [0.0] * len(shares)


@dataclass
class TruthReport:
    steps: list[StepRecord]  # the run with the loop
    believed: list[StepRecord]  # the believed plan without the loop
    best: list[StepRecord]  # the true-factor plan
    notes: list[list[str]]
    refits: list[dict[str, Any]]
    every: int
    plans: list[HexPlan] = field(default_factory=list)  # the plans the run followed, the first the believed

    def _rate(self, records: list[StepRecord]) -> float:
        last = records[-LAST:]
        return sum(s.tokens for s in last) / sum(s.step_s for s in last)

    @property
    def gap(self) -> float:
        """Tokens/s of the true-factor plan over the believed plan's, less one (last LAST steps)."""
        return self._rate(self.best) / self._rate(self.believed) - 1

    @property
    def recovered(self) -> float | None:
        """The fraction of the gap the loop recovered over the last LAST steps (None: the believed plan is no
        slower than the true-factor plan)."""
        best, believed = self._rate(self.best), self._rate(self.believed)
        if best <= believed:
            return None
        return (self._rate(self.steps) - believed) / (best - believed)

    @property
    def converged_step(self) -> int | None:
        """The step of the refit after which no later one moves a factor by more than CONVERGED."""
        for k, fit in enumerate(self.refits):
            if all(_close(fit["factors"], later["factors"]) for later in self.refits[k + 1 :]):
                return fit["step"]
        return None

    def per_step(self) -> list[dict[str, Any]]:
        return [
            {
                "step": k + 1,
                "end_s": s.end_s,
                "tokens_per_s": s.tokens / s.step_s,
                "tokens_per_s_believed_plan": b.tokens / b.step_s,
                "tokens_per_s_true_plan": t.tokens / t.step_s,
                "events": notes,
            }
            for k, (s, b, t, notes) in enumerate(
                zip(self.steps, self.believed, self.best, self.notes, strict=True)
            )
        ]

    def to_dict(self) -> dict[str, Any]:
        cpu = [r["cpu_s"] for r in self.refits]
        return {
            "every": self.every,
            "tokens_per_s_last": self._rate(self.steps),
            "tokens_per_s_believed_plan_last": self._rate(self.believed),
            "tokens_per_s_true_plan_last": self._rate(self.best),
            "gap": self.gap,
            "recovered": self.recovered,
            "converged_step": self.converged_step,
            "replans": len(self.plans) - 1,
            "refit_cpu_s_max": max(cpu, default=0.0),
            "refits": self.refits,
            "per_step": self.per_step(),
        }


def _close(a: dict, b: dict) -> bool:
    return all(abs(b[t][f] / v - 1) <= CONVERGED for t, fs in a.items() if t in b for f, v in fs.items() if v)


def simulate_truth(
    recipe, plan: HexPlan, truth: Calibration, steps: int, seed: int = 0, every: int = EVERY,
    threshold: float = THRESHOLD, run: str = "simulate --truth",
) -> TruthReport:  # fmt: skip
    """``plan`` (made with the recipe's factors) run on ``truth`` with the online loop (see the module doc)."""
    true_recipe = replace(recipe, calibration=truth)
    believed = simulate(sim_spec(true_recipe, plan), steps, seed).steps
    best = simulate(sim_spec(true_recipe, plan_recipe(true_recipe)), steps, seed).steps
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    window = MeasurementWindow()
    current, plans = plan, [plan]
    loop = _Measured(true_recipe, current, seed, window)
    done: list[StepRecord] = []  # the steps of earlier plans
    offset = 0.0
    notes: list[list[str]] = []
    refits: list[dict[str, Any]] = []
    while len(done) + len(loop.steps) < steps:
        boundary = min(steps, ((len(done) + len(loop.steps)) // every + 1) * every)
        loop.run(boundary - len(done), warmup=0)  # the loop goes on from where it stopped
        step = len(done) + len(loop.steps)
        notes += [[] for _ in range(step - len(notes))]
        measured = window.measured()
        if step >= steps or measured.steps < 2:
            continue
        started = time.process_time()
        fit = refit(cm, plan_layout(current, recipe.hex.transport), measured, run, prior=recipe.calibration)
        cpu = time.process_time() - started
        cm = cm.with_calibration(fit.calibration)
        started = time.process_time()
        decision = decide(recipe, current, fit.calibration, change_threshold(threshold, measured), step)
        refits.append({"step": step, "cpu_s": cpu, "replan_cpu_s": time.process_time() - started,
                       "factors": fit.factors, "rms_log_error": fit.rms_log_error, "points": fit.points,
                       "decision": decision.to_dict()})  # fmt: skip
        notes[-1].append(f"refit ({cpu:.2f} CPU s, residual {fit.rms_log_error:.1%})")
        if decision.suggested:
            done += [_shifted(s, offset) for s in loop.steps]
            offset = done[-1].end_s
            current = decision.plan
            plans.append(current)
            retuned = "".join(f", {r}" for r in decision.retuned)
            notes[-1].append(
                f"re-plan: {len(decision.diff)} machines change{retuned}, {decision.running_tokens_per_s:,.0f} -> "
                f"{decision.tokens_per_s:,.0f} tokens/s predicted"
            )
            window.restart()
            loop = _Measured(true_recipe, current, seed + len(plans), window)
        elif decision.share_gain > decision.threshold:
            current = decision.reshared(step)
            loop.route(decision.shares)
            notes[-1].append("shares re-solved")
    done += [_shifted(s, offset) for s in loop.steps]
    return TruthReport(done[:steps], believed, best, notes[:steps], refits, every, plans)


def _shifted(step: StepRecord, offset: float) -> StepRecord:
    return replace(step, start_s=step.start_s + offset)


def describe_truth(report: TruthReport, truth_file: str | Path, stream=None) -> str:
    """Console text: per step tokens/s of the run with the loop, the believed plan and the true-factor plan."""
    from areal_hex_plugin.tables import render_table

    rows = [
        [str(r["step"]), f"{r['end_s']:,.0f}", f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_believed_plan']:,.0f}",
         f"{r['tokens_per_s_true_plan']:,.0f}", "; ".join(r["events"])]
        for r in report.per_step()
    ]  # fmt: skip
    headers = ["step", "ends (s)", "tokens/s", "believed plan", "true-factor plan", "online loop"]
    d = report.to_dict()
    recovered = "no gap to recover" if d["recovered"] is None else f"{d['recovered']:.0%} of it recovered"
    converged = d["converged_step"]
    cpu = [r["cpu_s"] for r in report.refits]
    return "\n".join(
        [
            f"online refit on the true factors of {truth_file}: refit every {report.every} steps",
            render_table(headers, rows, right=headers[:5], stream=stream),
            "",
            f"last {min(LAST, len(report.steps))} steps: {d['tokens_per_s_last']:,.0f} tokens/s with the loop, "
            f"{d['tokens_per_s_believed_plan_last']:,.0f} on the believed plan, "
            f"{d['tokens_per_s_true_plan_last']:,.0f} on the true-factor plan (gap {d['gap']:+.1%}: {recovered})",
            f"refits: {len(cpu)}, converged at step {converged}; re-plans: {d['replans']}; CPU seconds per refit "
            f"at most {max(cpu, default=0.0):.2f}"
            if converged is not None
            else f"refits: {len(cpu)}, not converged; re-plans: {d['replans']}",
        ]
    )
