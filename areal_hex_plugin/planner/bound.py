"""A proven bound on what any plan of the search space reaches: a linear relaxation that respects the budget.

Per pool, a machine trains at most ``a_p`` steps/s (its GPUs' FLOPs at the type's MFU over the step's training
FLOPs: every layout's slowest stage takes at least that long, communication and bubbles only add) and generates
at most ``h_p`` tokens/s (its GPUs at the best tokens/s per GPU of any replica shape, unthrottled; the window's
integer shares and KV rebuilds only add). With t_p training and r_p rollout machines (real numbers), a step takes
at least max(1 / sum_p a_p t_p, G / sum_p h_p r_p + reward), G the tokens generated per step. The best such step
within the machine limits and the budget is found by bisection on the step rate z, each z a small LP on GLOP:
the least $/h with sum a t >= z and sum h r >= z G / (1 - z reward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from areal_hex_plugin.costmodel.train import TrainStage, estimate_train
from areal_hex_plugin.planner.evaluate import Evaluator

_BISECTIONS = 60


@dataclass(frozen=True)
class Relaxation:
    train_rate: tuple[float, ...]  # a_p: training steps/s per machine
    rollout_rate: tuple[float, ...]  # h_p: generated tokens/s per machine
    price: tuple[float, ...]  # $/h per machine
    generated: float  # G: tokens generated per step
    reward_s: float

    def cheapest(self, z: float, limits: tuple[int, ...]) -> float:
        """The least $/h of a fractional split stepping at ``z`` steps/s (inf when none does)."""
        if z * self.reward_s >= 1:
            return math.inf
        need = z * self.generated / (1 - z * self.reward_s)
        lp = pywraplp.Solver.CreateSolver("GLOP")
        t = [lp.NumVar(0, m, f"t_{i}") for i, m in enumerate(limits)]
        r = [lp.NumVar(0, m, f"r_{i}") for i, m in enumerate(limits)]
        for ti, ri, m in zip(t, r, limits, strict=True):
            lp.Add(ti + ri <= m)  # a machine trains or generates
        lp.Add(sum(a * ti for a, ti in zip(self.train_rate, t, strict=True)) >= z)
        lp.Add(sum(h * ri for h, ri in zip(self.rollout_rate, r, strict=True)) >= need)
        lp.Minimize(sum(c * (ti + ri) for c, ti, ri in zip(self.price, t, r, strict=True)))
        if lp.Solve() != pywraplp.Solver.OPTIMAL:
            return math.inf
        return lp.Objective().Value()

    def max_rate(self, limits: tuple[int, ...], budget: float | None) -> float:
        """The highest step rate (steps/s) any fractional split within ``limits`` and ``budget`` reaches."""
        cap = sum(a * m for a, m in zip(self.train_rate, limits, strict=True))
        if self.reward_s > 0:
            cap = min(cap, 1 / self.reward_s)

        def fits(z: float) -> bool:
            cost = self.cheapest(z, limits)
            return math.isfinite(cost) and (budget is None or cost <= budget * (1 + 1e-9))

        lo, hi = 0.0, cap
        if fits(hi):
            return hi
        for _ in range(_BISECTIONS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return hi  # the least rate not shown infeasible: still an upper bound


def relaxation(ev: Evaluator) -> Relaxation:
    train, rollout = [], []
    for pool in ev.cluster.pools:
        one = estimate_train(
            ev.cluster, ev.workload, ev.cm.calibration, (TrainStage(pool.name, 1, 1),), check_memory=False
        )
        compute = one.breakdown.get("compute", 0.0)
        train.append(pool.gpus_per_machine / compute if compute > 0 else 0.0)
        per_gpu = max((c.tokens_per_s / c.gpus for c in ev.replica_configs(pool.name)), default=0.0)
        rollout.append(per_gpu * pool.gpus_per_machine)
    samples = ev.workload.rl.samples_per_step
    return Relaxation(
        tuple(train),
        tuple(rollout),
        tuple(p.price_per_machine_hour for p in ev.cluster.pools),
        samples * ev.workload.output_lengths.mean,
        ev.cm.reward_s(samples),
    )


def throughput_bound(ev: Evaluator, limits: tuple[int, ...], budget: float | None) -> float:
    """Tokens/s no plan within ``limits`` and ``budget`` exceeds."""
    return ev.tokens_per_step * relaxation(ev).max_rate(limits, budget)


def cost_bound(ev: Evaluator, limits: tuple[int, ...], target_tokens_per_s: float) -> float:
    """$/h below which no plan within ``limits`` reaches ``target_tokens_per_s``."""
    return relaxation(ev).cheapest(target_tokens_per_s / ev.tokens_per_step, limits)
