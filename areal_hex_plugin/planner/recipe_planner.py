"""Plan a recipe: pick the objective, run the search, add baselines and the frontier, and write a HexPlan."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from areal_hex_plugin.costmodel.rollout import RolloutStage
from areal_hex_plugin.costmodel.sources import phase_sources
from areal_hex_plugin.costmodel.weightsync import strategy_for
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import (
    Baseline,
    HexPlan,
    Objective,
    ParetoPoint,
    Predicted,
    Sensitivity,
    SolverInfo,
    Staleness,
)
from areal_hex_plugin.planner.as_written import recipe_allocations, score_as_written
from areal_hex_plugin.planner.bound import cost_bound, throughput_bound
from areal_hex_plugin.planner.brute import BruteForce, Enumerated, check_size
from areal_hex_plugin.planner.caps import RuntimeCaps, recipe_caps, unmet
from areal_hex_plugin.planner.cpsat import clock
from areal_hex_plugin.planner.evaluate import Evaluation, Evaluator
from areal_hex_plugin.planner.explain import binding_constraint, describe_binding, describe_role, pool_roles
from areal_hex_plugin.planner.inflight import (
    held_runtime,
    serial_rollout_s,
)
from areal_hex_plugin.planner.interval import (
    ceiling_pick,
    describe_interval_flip,
    interval_flips,
    plan_interval,
    tie_band,
)
from areal_hex_plugin.planner.machine_assignment import place
from areal_hex_plugin.planner.preemption import preemption_of
from areal_hex_plugin.planner.search import THROUGHPUT_TIE, SearchResult, steering_eta, two_phase
from areal_hex_plugin.planner.sensitivity import (
    FLIP_CHANGE,
    STEP,
    WORKLOAD,
    Held,
    Rules,
    describe_flip,
    flips,
    plan_elasticities,
)
from areal_hex_plugin.planner.train_search import tp_degrees

# Budget levels of the Pareto sweep (fractions of the whole inventory's price).
PARETO_LEVELS = 8
# A costlier point joins the frontier only if it is at least this much faster (not by rounding noise).
PARETO_MIN_GAIN = 1e-3
# Share of hex.solver.time_limit_s for the chosen plan's search (baselines and the frontier get the rest).
MAIN_SEARCH_SHARE = 0.6
# Steered splits near the chosen plan that the flip check scores beside the rescored ones.
NEAR = 32
# Budget bisection steps for a throughput target.
TARGET_STEPS = 12
# Alternatives printed beside the plan (HexPlan.alternatives): the cheapest plan within WITHIN_SHARE of the fastest
# tokens/s, and the frontier's knee.
WITHIN = "cheapest_within_2pct"
WITHIN_SHARE = 0.02
KNEE = "knee"
# The recipe's own allocation (planner/as_written.py): its name among the baselines, and SolverInfo.mode of its plan.
AS_WRITTEN = "as-written"
AS_WRITTEN_MODE = "as_written"
# The default pick: the budget is a ceiling (planner/interval.py).
INTERVAL_PICK = "cheapest_within_interval"


@dataclass(frozen=True)
class PlanRequest:
    """What to plan; ``budget_per_hour``/``target_tokens_per_s`` override the recipe's ``hex.objective``;
    ``caps``: the runtime the plan must run on (None: the recipe's backends; ``caps.PAPER``: unconstrained)."""

    exhaustive: bool = False
    budget_per_hour: float | None = None
    target_tokens_per_s: float | None = None
    pareto: bool = False
    caps: RuntimeCaps | None = None
    sensitivity: bool = False  # add HexPlan.sensitivity (planner/sensitivity.py) and warn of flips
    pick: str | None = None  # overrides hex.objective.pick (None: the recipe's)


def objective_of(recipe, request: PlanRequest) -> Objective:
    budget, target = request.budget_per_hour, request.target_tokens_per_s
    if budget is None and target is None:
        budget = recipe.hex.objective.budget_per_hour
        target = recipe.hex.objective.target_tokens_per_s
    if budget is not None and target is not None:
        raise HexError(
            "--budget", "a budget and a throughput target were both given", "give only one of them"
        )
    for name, value in (("--budget", budget), ("--target-tokens-per-s", target)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise HexError(name, f"must be a positive number, got {value:g}", "give a finite value > 0")
    pick, tolerance = request.pick or recipe.hex.objective.pick, recipe.hex.objective.throughput_tolerance
    if target is not None and (pick == "knee" or tolerance):
        field = "hex.objective.pick" if pick == "knee" else "hex.objective.throughput_tolerance"
        raise HexError(
            field,
            "picks a plan from the frontier within a budget or the whole inventory, not for a throughput target",
            "drop it, or give a budget instead of the target",
        )
    if target is not None:
        return Objective("target", target_tokens_per_s=target, pick=pick)
    band = round(tie_band(recipe.calibration, recipe.cluster.gpu_types), 4) if pick == INTERVAL_PICK else None
    kind = "budget" if budget is not None else "max_throughput"
    return Objective(kind, budget, pick=pick, throughput_tolerance=tolerance, tie_band=band)


class Planner:
    """One planning session over one recipe: a shared memo of phase-1 scores for every search it runs."""

    def __init__(self, recipe, request: PlanRequest) -> None:
        from areal_hex_plugin.costmodel import CostModel

        self.recipe = recipe
        self.request = request
        self.cluster = recipe.calibration.on(recipe.cluster)  # a refit's catalog figures in place
        self.solver = recipe.solver
        self.objective = objective_of(recipe, request)
        self.caps = request.caps or recipe_caps(recipe)
        # The runtime's actor prices every layout (the paper's space: one stage on FSDP, pipelines on Megatron).
        self.workload = recipe.workload.on_megatron(self.caps.name == "megatron")
        self.limits = tuple(p.machines for p in self.cluster.pools)
        _check_rollout_layout(self.solver, self.cluster)
        self.eta = self.workload.rl.max_head_offpolicyness
        self.wall_start = time.monotonic()
        self.start = clock()
        self.deadline = self.start + self.solver.time_limit_s
        # The chosen plan's search may use this share of the time limit; baselines and the frontier the rest.
        self.main_deadline = self.start + MAIN_SEARCH_SHARE * self.solver.time_limit_s
        # The search is steered at a fixed eta (``steer``, search.steering_eta); every plan, baseline and
        # explanation is scored at the recipe's eta (``ev``, which reads the steering memos eta does not change
        # and keeps its own work off the search's clock), so the splits the searches visit are the same for
        # every eta >= 1.
        steer_workload = self.workload.at_eta(steering_eta(self.eta))
        steer_cm = CostModel(self.cluster, steer_workload, recipe.calibration)
        self.steer = Evaluator(
            steer_cm,
            self.cluster,
            steer_cm.workload,
            self.solver,
            sync_strategy=strategy_for(recipe.hex.transport),
            caps=self.caps,
            preemption=preemption_of(recipe),
        )
        self.ev = self.steer.at_eta(self.eta)
        self.cm = self.ev.cm
        # --exhaustive: the brute force of planner/brute.py, what it covered, and the plans it returned.
        self.brute = BruteForce(self.ev) if request.exhaustive else None
        self.enumerated = Enumerated()
        self.found: list[Evaluation] = []
        if self.brute:
            check_size(self.ev, self.limits)
            if self.ev.preemption:
                raise HexError(
                    "--exhaustive",
                    "the brute force does not price preemptible pools (planner/preemption.py)",
                    "plan without --exhaustive",
                )

    def search(
        self,
        limits: tuple[int, ...],
        budget: float | None,
        deadline: float | None = None,
        target: float | None = None,
    ) -> SearchResult:
        """The best plan within ``limits`` and ``budget`` (with ``target``, exhaustive mode only: the cheapest
        reaching it)."""
        if self.brute is None:
            return two_phase(self.steer, self.ev, limits, budget, deadline or self.deadline)
        result, enumerated = self.brute.exhaustive(limits, budget, target)
        self.enumerated += enumerated
        if result.best is not None and target is None:
            # As the two-phase search: the cheapest plan within THROUGHPUT_TIE of the fastest.
            floor = (1 - THROUGHPUT_TIE) * self.tokens_per_s(result.best)
            cheaper, enumerated = self.brute.exhaustive(limits, budget, floor)
            self.enumerated += enumerated
            self.found.append(result.best)
            result = cheaper if cheaper.best is not None else result
        if result.best is not None:
            self.found.append(result.best)
        return result

    def tokens_per_s(self, e: Evaluation | None) -> float:
        return e.tokens_per_s(self.ev.tokens_per_step) if e is not None else 0.0

    def solve(self) -> HexPlan:
        warnings: list[str] = []
        result = self._solve_objective()
        best = result.best
        if best is None:
            raise self._nothing_fits(result)
        if result.status == "timeout":
            warnings.append(
                f"the solver hit hex.solver.time_limit_s={self.solver.time_limit_s:g}s; this is the best plan found"
            )
        if len(self.cluster.gpu_types) == 1:
            warnings.append(
                f"the cluster has one GPU type ({self.cluster.gpu_types[0]}): this is the best homogeneous plan"
            )
        baselines, rivals = self._baselines(
            self.objective.budget_per_hour or (result.steered or best).cost_per_hour
        )
        written = self._as_written_row(baselines)  # a rival too where the objective's budget allows it
        chosen = self._preferred([best, *rivals, *written])
        if chosen is not best:
            which = (
                "the recipe's allocation as written"
                if any(chosen is w for w in written)
                else "a single-type plan the baselines found"
            )
            warnings.append(f"{which} beats the mixed search's plan ({result.status}), so it is the plan")
            best = chosen
        swept = self.request.pareto or self.objective.pick == "knee"
        if swept:
            self._sweep()
        best = self._picked(best, [*rivals, *written])
        frontier = self._frontier(best)
        alternatives = self._alternatives(frontier)
        baselines["uniform"] = self._uniform_baseline(best)
        gap = 0.0 if result.status == "optimal" else self._gap(best)
        if best.c_t > best.c_i:
            warnings.append(
                f"training is the bottleneck (C_T {best.c_t:.1f}s > C_I {best.c_i:.1f}s): rollout will wait at the "
                f"staleness bound (eta={self.eta}); the paper's schedule assumes C_I >= C_T"
            )
        pareto = [self._point(e) for e in frontier] if swept else []
        self.chosen, self.rivals = best, rivals
        solve_time = time.monotonic() - self.wall_start
        plan = self._plan(best, result, gap, solve_time, baselines, pareto, warnings)
        return replace(plan, alternatives={name: self._point(e) for name, e in alternatives.items()})

    def _solve_objective(self) -> SearchResult:
        obj = self.objective
        if obj.kind == "budget":
            return self.search(self.limits, obj.budget_per_hour, self.main_deadline)
        full = self.search(self.limits, None, self.main_deadline)
        if obj.kind == "max_throughput" or full.best is None:
            return full
        return self._cheapest_reaching(obj.target_tokens_per_s, full)

    def _cheapest_reaching(self, target: float, full: SearchResult) -> SearchResult:
        best_rate = self.tokens_per_s(full.best)
        if best_rate < target:
            raise HexError(
                "hex.objective.target_tokens_per_s",
                f"{target:,.0f} tokens/s is out of reach: the whole inventory gives at most {best_rate:,.0f} "
                f"tokens/s (${full.best.cost_per_hour:,.2f}/h)",
                "lower the target, or add machines to hex.cluster",
            )
        if self.brute is not None:
            return self.search(self.limits, None, target=target)
        lo, hi = 0.0, full.best.cost_per_hour
        chosen, iterations = full, full.iterations
        step = min(p.price_per_machine_hour for p in self.cluster.pools)
        for _ in range(TARGET_STEPS):
            if hi - lo < step / 2 or clock() > self.main_deadline:
                break
            mid = (lo + hi) / 2
            trial = self.search(self.limits, mid, self.main_deadline)
            iterations += trial.iterations
            if trial.best is not None and self.tokens_per_s(trial.best) >= target:
                hi = trial.best.cost_per_hour
                chosen = trial
            else:
                lo = mid
        # Any split already scored that reaches the target more cheaply is as good an answer.
        reaching = [e for e in self.ev.scored() if e.feasible and self.tokens_per_s(e) >= target]
        best = min(reaching, key=lambda e: (round(e.cost_per_hour, 6), -self.tokens_per_s(e), e.split))
        status = "timeout" if clock() > self.main_deadline else chosen.status
        return SearchResult(best, status, iterations)

    def _nothing_fits(self, result: SearchResult) -> HexError:
        if result.status == "timeout":
            return HexError(
                "hex.solver.time_limit_s",
                f"no feasible plan was found within {self.solver.time_limit_s:g}s",
                "raise hex.solver.time_limit_s",
            )
        if self.objective.kind == "budget":
            field = (
                "--budget" if self.request.budget_per_hour is not None else "hex.objective.budget_per_hour"
            )
            problem = f"no trainer plus rollout split fits in ${self.objective.budget_per_hour:g}/h"
            cheapest = self._cheapest_plan()
            if cheapest is None:
                return HexError(field, problem, "raise the budget or add cheaper machines")
            cents = math.ceil(round(cheapest.cost_per_hour * 100, 6)) / 100
            used = ", ".join(f"{n} {gpu}" for gpu, n in self._gpus_by_type(cheapest).items())
            return HexError(
                field,
                f"{problem}; the cheapest plan found costs ${cents:.2f}/h ({used} GPUs)",
                f"raise the budget to {cents:.2f} or more, or add cheaper machines",
            )
        return HexError(
            "hex.cluster",
            f"no split of this inventory into trainer and rollout machines fits {self.workload.model.name}",
            "add machines or GPUs with more memory, or choose a smaller model",
        )

    def _cheapest_plan(self) -> Evaluation | None:
        """The cheapest plan the search finds on the whole inventory (the cheapest reaching any throughput), or
        None when none fits at any price."""
        full = self.search(self.limits, None, self.deadline)
        return self._cheapest_reaching(0.0, full).best if full.best is not None else None

    def _gap(self, best: Evaluation) -> float | None:
        """How far ``best`` may be from the optimum, proven by the relaxation of ``planner/bound.py``: on
        tokens/s within the budget, or on $/h for a target; None when no finite bound is known."""
        target = self.objective.target_tokens_per_s
        if target is not None:
            floor = cost_bound(self.ev, self.limits, target)
            ok = math.isfinite(floor) and best.cost_per_hour > 0
            return round(max(0.0, 1 - floor / best.cost_per_hour), 6) if ok else None
        bound = throughput_bound(self.ev, self.limits, self.objective.budget_per_hour)
        if not math.isfinite(bound) or bound <= 0:
            return None
        return round(max(0.0, 1 - self.tokens_per_s(best) / bound), 6)

    def _preferred(self, candidates: list[Evaluation]) -> Evaluation:
        """The candidate the objective prefers: the cheapest reaching a target (then the fastest), else the
        fastest (then the cheapest); the first one on a tie."""
        target = self.objective.target_tokens_per_s

        def key(e: Evaluation):
            rate, cost = round(self.tokens_per_s(e), 6), round(e.cost_per_hour, 6)
            if target is not None:
                return (rate >= target, -cost, rate)
            return (rate, -cost)

        return max(candidates, key=key)

    def _baselines(self, budget: float) -> tuple[dict[str, Baseline], list[Evaluation]]:
        """The best plan on each GPU type alone within ``budget`` (the objective's; else the cost of the search's
        steering best, the same at every eta; else, for a target, the chosen plan's), and their evaluations."""
        baselines: dict[str, Baseline] = {}
        rivals: list[Evaluation] = []
        for gpu_type in self.cluster.gpu_types:
            limits = tuple(
                m if p.gpu_type == gpu_type else 0
                for p, m in zip(self.cluster.pools, self.limits, strict=True)
            )
            result = self.search(limits, budget)
            name = f"homogeneous-{gpu_type}"
            if result.best is None:
                machines = sum(limits)
                pre = self.ev.preemption
                kept_off = pre is not None and not pre.train_allowed
                why = (
                    "not solved within the time limit"
                    if result.status == "timeout"
                    else "training is kept off preemptible pools (hex.solver.train_on_preemptible)"
                    if kept_off and all(p.preemptible for p in self.cluster.pools if p.gpu_type == gpu_type)
                    else "no trainer + rollout split fits"
                )
                note = f"{why} on {machines} {gpu_type} machine(s) within ${budget:,.2f}/h"
                baselines[name] = Baseline(0.0, 0.0, {}, note=note)
                continue
            e = result.best
            rivals.append(e)
            inventory = sum(
                p.n_gpus * p.price_per_gpu_hour for p in self.cluster.pools if p.gpu_type == gpu_type
            )
            note = f"whole {gpu_type} inventory (${inventory:,.2f}/h)" if inventory < budget else ""
            baselines[name] = self._baseline(e, note)
        return baselines, rivals

    def as_written(self) -> tuple[Evaluation, HexPlan]:
        """The recipe's ``actor.backend`` and ``rollout.backend`` placed as upstream places them and scored as every
        plan is (``planner/as_written.py``), and its plan (no search, no baselines); HexError names the backend that
        does not fit the cluster or its memory, or that the runtime cannot start."""
        actor, rollout = recipe_allocations(self.recipe)
        e = score_as_written(self.ev, actor, rollout, self.caps.split_machines)
        warnings = []
        budget, target = self.objective.budget_per_hour, self.objective.target_tokens_per_s
        if budget is not None and e.cost_per_hour > budget + 1e-9:
            warnings.append(
                f"as written it costs ${e.cost_per_hour:,.2f}/h, over the budget of ${budget:,.2f}/h"
            )
        if target is not None and self.tokens_per_s(e) < target:
            warnings.append(f"as written it falls short of the target of {target:,.0f} tokens/s")
        solve_time = time.monotonic() - self.wall_start
        plan = self._plan(
            e, SearchResult(e, "feasible", 0), None, solve_time, {}, [], warnings, AS_WRITTEN_MODE
        )
        # Upstream's admission as written; no pool's role is the search's choice.
        rl = self.workload.rl
        staleness = Staleness(self.eta, rl.max_concurrent_rollouts or rl.consumer_batch_size)
        plan = replace(plan, staleness=staleness, pool_roles={}, pool_role_reasons={})
        lacking = unmet(plan, self.caps)
        if lacking:
            what, why = next(iter(lacking.items()))
            raise HexError(
                "rollout.backend" if "rollout" in what else "actor.backend",
                f"{self.caps.describe()} cannot start it as written: {why}",
                "change the backend strings, hex.transport or actor.weight_update_mode to a runtime that can",
            )
        return e, plan

    def _as_written_row(self, baselines: dict[str, Baseline]) -> list[Evaluation]:
        """Add the recipe's allocation as written to ``baselines`` where its backends are shapes the runtime starts
        on the cluster and the runtime planned for is the recipe's actor (whose engine prices the layout); returns
        it where the objective's budget allows it (a rival the plan must not lose to), else nothing."""
        actor = str((self.recipe.config.get("actor") or {}).get("backend", "")).split(":", 1)[0].strip()
        if self.caps.name != actor:
            return []
        try:
            e, _ = self.as_written()
        except HexError:
            return []
        backends = f"{self.recipe.config['actor']['backend']} + {self.recipe.config['rollout']['backend']}"
        budget = self.objective.budget_per_hour
        over = budget is not None and e.cost_per_hour > budget + 1e-9
        baselines[AS_WRITTEN] = self._baseline(
            e, f"{backends} as upstream places them" + (", over the budget" if over else "")
        )
        return [] if over else [e]

    def _uniform_baseline(self, best: Evaluation) -> Baseline:
        """The uniform ablation of ``best``, with its interval's relative width (the same machines and factors)."""
        return self._baseline(
            best, "same machines, samples split evenly across replicas", self._uniform(best)
        )

    def _baseline(self, e: Evaluation, note: str, rate: float | None = None) -> Baseline:
        """A baseline row for ``e`` at ``rate`` tokens/s (default: as scored), with its interval."""
        scored = self.tokens_per_s(e)
        rate = scored if rate is None else rate
        low, high = (end * rate / scored for end in self._interval(e)) if scored > 0 else (0.0, 0.0)
        return Baseline(
            round(rate, 3),
            round(e.cost_per_hour, 4),
            self._gpus_by_type(e),
            note,
            round(low, 3),
            round(high, 3),
        )

    def _interval(self, e: Evaluation) -> tuple[float, float]:
        """(low, high) of ``e``'s tokens/s (``planner/interval.py``)."""
        held = Held.of_evaluation(e, self.cm)
        return plan_interval(self.cm, self._rules(), held, self._gpus_by_type(e), self.tokens_per_s(e))

    def _uniform(self, e: Evaluation) -> float:
        """The paper's ablation: the chosen split, but every replica gets the same number of samples."""
        window = e.window
        rollout = serial_rollout_s(held_runtime(self.cm, e.fleet.groups, window, even=True), e.train_s)
        if e.loss is not None:  # priced as the plan is
            return self.ev.tokens_per_step / e.loss.step_s(e.sync_s / window, rollout, e.train_s)
        return self.ev.tokens_per_step / (e.sync_s / window + max(rollout, e.train_s))

    def _gpus_by_type(self, e: Evaluation) -> dict[str, int]:
        gpus: dict[str, int] = {}
        for i, pool in enumerate(self.cluster.pools):
            if e.split.machines(i):
                gpus[pool.gpu_type] = gpus.get(pool.gpu_type, 0) + e.split.machines(i) * pool.gpus_per_machine
        return gpus

    def _sweep(self) -> None:
        """The searches of the Pareto sweep: the best plan at budget levels across the inventory (their splits
        join :meth:`_scored`)."""
        full = self.cluster.price_per_hour
        for level in range(1, PARETO_LEVELS):
            if clock() > self.deadline:
                break
            self.search(self.limits, full * level / PARETO_LEVELS)

    def _scored(self) -> list[Evaluation]:
        """Every feasible plan scored at the recipe's eta (all searches so far, the brute force's included),
        cheapest first, then fastest."""
        points = {e.split: e for e in [*self.ev.scored(), *self.found] if e.feasible}.values()
        return sorted(points, key=lambda e: (e.cost_per_hour, -self.tokens_per_s(e), e.split))

    def _within_budget(self, points: list[Evaluation]) -> list[Evaluation]:
        budget = self.objective.budget_per_hour
        return [e for e in points if budget is None or e.cost_per_hour <= budget + 1e-9]

    def _picked(self, best: Evaluation, rivals: list[Evaluation], rate=None) -> Evaluation:
        """The plan the objective picks among every plan scored within it: for a target ``best`` (the cheapest
        reaching it); else the cheapest within THROUGHPUT_TIE of the fastest and no slower than a baseline
        (``rivals``: the plan never loses to one it prints), then the cheapest within ``throughput_tolerance``
        of that (``pick: fastest``) or the frontier's knee (``pick: knee``); ``pick: cheapest_within_interval``:
        the cheapest of them and the baselines within the objective's tie band (``throughput_tolerance`` where
        wider) of the fastest (the budget is a ceiling). Every point scored is the same at
        every eta (the searches are steered at a fixed eta), so the fastest is monotone in eta. ``rate``: each
        plan's tokens/s (default: as scored)."""
        obj = self.objective
        if obj.kind == "target":
            return best
        points = self._within_budget(self._scored())
        if best not in points:
            points.append(best)
        rate = rate or self.tokens_per_s
        floor = max([(1 - THROUGHPUT_TIE) * max(rate(e) for e in points), *map(rate, rivals)])
        best = _cheapest_reaching(points, floor, rate)
        if obj.pick == INTERVAL_PICK:
            return ceiling_pick([*points, *rivals], rate, _cost, _band(obj))
        if obj.pick == "knee":
            return knee(self._within_budget(self._frontier(best, rate)), rate)
        return _cheapest_reaching(points, (1 - obj.throughput_tolerance) * rate(best), rate)

    def _frontier(self, chosen: Evaluation, rate=None) -> list[Evaluation]:
        """Cost vs tokens/s, cheapest first: the non-dominated plans scored (a costlier one joins only if
        PARETO_MIN_GAIN faster than the last), ``chosen`` among them (no cheaper plan scored is as fast: the
        objective picked it so)."""
        rate = rate or self.tokens_per_s
        points = [e for e in self._scored() if e.split != chosen.split] + [chosen]
        points.sort(key=lambda e: (e.cost_per_hour, -rate(e), e.split))
        frontier: list[Evaluation] = []
        for e in points:
            if e is chosen or not frontier or rate(e) > rate(frontier[-1]) * (1 + PARETO_MIN_GAIN):
                frontier.append(e)
        return frontier

    def _alternatives(self, frontier: list[Evaluation]) -> dict[str, Evaluation]:
        """On the frontier within the objective: the cheapest plan within WITHIN_SHARE of the fastest's tokens/s
        (with the default pick, whose band is at least as wide, never cheaper than the plan), and the knee (none
        for a throughput target: its plan is the cheapest reaching it)."""
        if self.objective.kind == "target":
            return {}
        inside = self._within_budget(frontier)
        floor = (1 - WITHIN_SHARE) * max(self.tokens_per_s(e) for e in inside)
        return {
            WITHIN: _cheapest_reaching(inside, floor, self.tokens_per_s),
            KNEE: knee(inside, self.tokens_per_s),
        }

    def with_sensitivity(self, plan: HexPlan) -> HexPlan:
        """``plan`` (this planner's) with what its ranking hangs on, and a warning per flip
        (``planner/sensitivity.py``)."""
        rules, chosen = self._rules(), self.chosen
        factors = plan_elasticities(
            self.cm,
            rules,
            Held.of_evaluation(chosen, self.cm),
            [Held.of_evaluation(e, self.cm) for e in self.rivals],
        )
        near = self._steered_near(chosen)
        candidates = list({e.split: e for e in [*self._scored(), *near, *self.rivals, chosen]}.values())

        def pick(rate):
            if self.objective.kind != "target":
                return self._picked(chosen, self.rivals, rate)
            target = self.objective.target_tokens_per_s
            reaching = [e for e in candidates if rate(e) >= target]
            return _cheapest_reaching(reaching, target, rate) if reaching else None

        found = flips(self.cm, rules, candidates, pick, chosen)
        inside = interval_flips(self.cm, rules, candidates, pick, chosen)
        sensitivity = Sensitivity(
            step=STEP,
            factors={k: v for k, v in factors.items() if k != WORKLOAD},
            workload=factors.get(WORKLOAD, {}),
            flip_change=FLIP_CHANGE,
            candidates=len(candidates),
            flips=found,
            interval_flips=inside,
        )
        cost, recipe = plan.predicted.cost_per_hour, str(self.recipe.path)
        warnings = [
            *plan.warnings,
            *(describe_interval_flip(f, self.cm.calibration, recipe, cost) for f in inside),
            *(describe_flip(f, cost) for f in found),
        ]
        return replace(plan, sensitivity=sensitivity, warnings=warnings)

    def _rules(self) -> Rules:
        return Rules(strategy_for(self.recipe.hex.transport), self.ev.preemption)

    def _steered_near(self, chosen: Evaluation) -> list[Evaluation]:
        """The splits the steering scored within FLIP_CHANGE of the chosen plan (at most NEAR of them, fastest
        first), scored at the recipe's eta: the rescoring keeps one split per steering score, so a split that
        ties another never reached it, yet a small change can pick it."""
        tokens, budget = self.steer.tokens_per_step, self.objective.budget_per_hour
        floor = (1 - FLIP_CHANGE) * self.steer.evaluate(chosen.split).tokens_per_s(tokens)
        near = sorted(
            (
                (-e.tokens_per_s(tokens), split)
                for split, e in self.steer.scored_splits().items()
                if e.feasible
                and e.tokens_per_s(tokens) >= floor
                and all(split.machines(i) <= m for i, m in enumerate(self.limits))
                and (budget is None or split.cost_per_hour(self.cluster) <= budget + 1e-9)
            ),
        )[:NEAR]
        return [e for e in (self.ev.evaluate(split) for _, split in near) if e.feasible]

    def _point(self, e: Evaluation) -> ParetoPoint:
        return ParetoPoint(round(e.cost_per_hour, 4), round(self.tokens_per_s(e), 3), self._gpus_by_type(e))

    def _sources(self, best: Evaluation) -> dict[str, str]:
        """Where each predicted phase of ``best`` came from (costmodel/sources.py)."""
        types = {p.name: p.gpu_type for p in self.cluster.pools}
        rollout = [types[c.pool] for c, _ in best.fleet.groups]
        train = [types[s.pool] for s in best.train.stages] if best.train else []
        decode = {
            self.cm.rollout(tuple(RolloutStage(c.pool, c.tp) for _ in range(c.pp))).decode_source
            for c, _ in best.fleet.groups
        }
        phases = {"rollout": rollout, "train": train, "weight_sync": [*train, *rollout]}
        return phase_sources(self.cm.calibration, phases, " and ".join(sorted(decode)) or "roofline")

    def _plan(self, best, result, gap, solve_time, baselines, pareto, warnings, mode=None) -> HexPlan:
        train, rollout, machines = place(self.cluster, best)
        rate = self.tokens_per_s(best)
        low, high = self._interval(best)
        predicted = Predicted(
            tokens_per_s=round(rate, 3),
            tokens_per_s_low=round(low, 3),
            tokens_per_s_high=round(high, 3),
            step_time_s_low=round(best.step_s * rate / high, 4),
            step_time_s_high=round(best.step_s * rate / low, 4) if low > 0 else None,
            cost_per_hour=round(best.cost_per_hour, 4),
            tokens_per_dollar=round(rate * 3600 / best.cost_per_hour, 1),
            step_time_s=round(best.step_s, 4),
            train_time_s=round(best.train_s, 4),
            train_logp_s=round(best.train.estimate.logp_s, 4) if best.train else None,
            rollout_time_s=round(best.rollout_s, 4),
            weight_sync_s=round(best.sync_s / best.window, 4),
            reward_s=round(best.reward_s, 4),
            loss_free_tokens_per_s=round(self.ev.tokens_per_step / best.loss_free_step_s, 3),
            sources=self._sources(best),
        )
        # Upstream counts rollouts (one prompt with its n_samples samples), each holding its slot until its
        # longest sample ends: admit enough of them to keep every planned sequence decoding.
        in_flight = self.cm.prompts_to_fill(sum(g.concurrency * g.count for g in rollout.replicas))
        binding = binding_constraint(best, self.objective, self.cluster)
        roles = pool_roles(machines, self.cluster, self.limits)
        return HexPlan(
            recipe=str(self.recipe.path),
            model=self.workload.model.name,
            objective=self.objective,
            predicted=predicted,
            train=train,
            rollout=rollout,
            machines=machines,
            baselines=baselines,
            solver=SolverInfo(
                solve_time_s=round(solve_time, 3),
                status=result.status,
                iterations=result.iterations,
                gap=gap,
                mode=mode or ("exhaustive" if self.request.exhaustive else "two_phase"),
                window_steps=best.window,
                enumerated=self.enumerated.describe() if self.brute else "",
            ),
            staleness=Staleness(self.eta, in_flight),
            binding=describe_binding(binding, self.objective),
            pool_roles={name: describe_role(role) for name, role in roles.items()},
            binding_constraint=binding,
            pool_role_reasons=roles,
            pareto=pareto,
            warnings=warnings,
            runtime=self.caps.describe(),
        )


def plan_recipe(recipe, request: PlanRequest | None = None) -> HexPlan:
    """Plan ``recipe`` (see :class:`PlanRequest`); bad input raises :class:`HexError`.

    A runtime that needs one rollout layout for every server (upstream's xccl weight path) is planned once per
    layout a server can have, unless ``hex.solver.rollout_layout`` fixes it; the best of those is the plan."""
    request = request or PlanRequest()
    request = replace(request, caps=request.caps or recipe_caps(recipe))
    plan, planner = _solve(recipe, request)
    return planner.with_sensitivity(plan) if request.sensitivity else plan


def plan_as_written(recipe, request: PlanRequest | None = None) -> HexPlan:
    """The recipe's ``actor.backend`` and ``rollout.backend`` scored as written on its cluster, with no search
    (``planner/as_written.py``; ``request``: its objective only, for the warnings); a shape that does not fit the
    cluster or its memory raises HexError naming it."""
    request = replace(request or PlanRequest(), caps=recipe_caps(recipe))
    return Planner(recipe, request).as_written()[1]


def _solve(recipe, request: PlanRequest) -> tuple[HexPlan, Planner]:
    """The plan and the planner that made it."""
    if not request.caps.one_rollout_layout or recipe.hex.solver.rollout_layout:
        planner = Planner(recipe, request)
        return planner.solve(), planner
    solved: list[tuple[HexPlan, Planner]] = []
    max_pp = min(recipe.solver.max_pp_stages, request.caps.max_rollout_pp or recipe.solver.max_pp_stages)
    for tp, pp in one_machine_layouts(recipe.cluster, max_pp):
        solver = replace(recipe.hex.solver, rollout_layout=[tp, pp])
        planner = Planner(replace(recipe, hex=replace(recipe.hex, solver=solver)), request)
        try:
            solved.append((planner.solve(), planner))
        except HexError:
            continue  # no plan with every server in this layout
    if not solved:
        raise HexError(
            "actor.weight_update_mode",
            f"no plan with one layout for every rollout server (weights by {request.caps.weight_path}) fits",
            "use hex.transport=relay, which updates servers of different layouts, or add machines",
        )
    # The fastest layout's plan (the cheapest on a tie); with the interval pick, the budget is a ceiling here too.
    obj = solved[0][0].objective
    if obj.pick == INTERVAL_PICK:
        return ceiling_pick(solved, lambda x: x[0].predicted.tokens_per_s, lambda x: x[0].predicted.cost_per_hour,
                            _band(obj))  # fmt: skip
    return max(solved, key=lambda x: (x[0].predicted.tokens_per_s, -x[0].predicted.cost_per_hour))


def _band(obj: Objective) -> float:
    """The interval pick's tie band: the objective's (the fit's residual spread, at least 2%), or
    ``throughput_tolerance`` where wider."""
    return max(obj.tie_band or 0.0, obj.throughput_tolerance)


def _cost(e: Evaluation) -> float:
    return round(e.cost_per_hour, 6)


def _cheapest_reaching(points: list[Evaluation], floor: float, rate) -> Evaluation:
    """The cheapest of ``points`` with at least ``floor`` tokens/s (``rate``), the fastest on a tie."""
    reaching = [e for e in points if rate(e) >= floor * (1 - 1e-12)]
    return min(reaching, key=lambda e: (round(e.cost_per_hour, 6), -rate(e), e.split))


def knee(frontier: list[Evaluation], rate) -> Evaluation:
    """The knee of a cost vs tokens/s frontier: the fastest plan whose $ per token is within WITHIN_SHARE of the
    frontier's lowest, past which each further $/h buys tokens dearer than the frontier's best. (A knee from the
    frontier's ends, Kneedle, moves with the cheapest plan scored, and on a straight frontier picks a plan no
    cheaper per token than the fastest.)"""

    def per_token(e: Evaluation) -> float:
        return e.cost_per_hour / rate(e)

    lowest = min(per_token(e) for e in frontier)
    return max(
        (e for e in frontier if per_token(e) <= (1 + WITHIN_SHARE) * lowest),
        key=lambda e: (rate(e), -e.cost_per_hour),
    )


def one_machine_layouts(cluster, max_pp: int) -> list[tuple[int, int]]:
    """Every rollout (tp, pp) whose server fits one machine of some pool, packed exactly."""
    layouts = set()
    for pool in cluster.pools:
        sizes = tp_degrees(pool.gpus_per_machine)
        layouts |= {(tp, pp) for tp in sizes for pp in range(1, max_pp + 1) if tp * pp in sizes}
    return sorted(layouts)


def _check_rollout_layout(solver, cluster) -> None:
    """A fixed rollout layout must be one the phase-1b search can build on some pool."""
    if not solver.rollout_layout:
        return
    tp, pp = solver.rollout_layout
    if pp > solver.max_pp_stages or not any(tp in tp_degrees(p.gpus_per_machine) for p in cluster.pools):
        degrees = sorted({d for p in cluster.pools for d in tp_degrees(p.gpus_per_machine)})
        raise HexError(
            "hex.solver.rollout_layout",
            f"[{tp}, {pp}] is not a layout any pool can run",
            f"use tp in {degrees} and pp <= hex.solver.max_pp_stages ({solver.max_pp_stages})",
        )
