"""Score a split: phase 1a on its training machines, phase 1b on its rollout machines, then the step.

The step follows the paper's metric: weight sync + max(rollout incl. reward, train), with C_T = train and
C_I = rollout + reward + weight sync. Two runtime settings are decisions of every split (:mod:`inflight`): the
window delta, the training steps per weight update of the rollout servers, and each replica's in-flight cap.
Costs are averaged over the window: its samples are split across replica groups by the split with the least
makespan (``inflight.best_split``; the busiest replica of each group sets it); the window pays one weight sync and
one KV rebuild.
"""

from __future__ import annotations

import math
from collections import ChainMap
from dataclasses import dataclass, field, replace
from itertools import product

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.planner.caps import PAPER, RuntimeCaps
from areal_hex_plugin.planner.cpsat import charge
from areal_hex_plugin.planner.inflight import (
    CAP_FRACTIONS,
    InFlight,
    Runtime,
    best_split,
    choose,
    replica_stages,
    rollout_floor,
    serial_rollout_s,
    window_rollout_s,
    windows,
)
from areal_hex_plugin.planner.preemption import Loss, Preemption
from areal_hex_plugin.planner.rollout_model import (
    ReplicaConfig,
    RolloutSolution,
    solve_rollout,
)
from areal_hex_plugin.planner.split import Split
from areal_hex_plugin.planner.train_search import ALL_DEPTHS, TrainChoice, search_train
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.config import SolverConfig
from areal_hex_plugin.specs.workload import WorkloadSpec

# Work charged per cost-model estimate computed (the search's clock, planner/cpsat.py).
ESTIMATE_WORK = 3e-4
# Candidate fleets of a split's rollout machines: every combination of the pools' fleets (each pool's bound and
# price fleets, :meth:`Evaluator.pool_candidates`) up to this many, else this many of one bound for every pool (by
# makespan) and a descent over each pool's fleets. 36: two pools of 6 fleets each are combined in full; 64 cost the
# 7B plan at 10,240 GPUs, where the search's work limit stops it, 23% of its tokens/s (benchmarks/planner.py).
ALL_COMBINATIONS = 36
CANDIDATES = 3
# Prices of an in-flight sequence (tokens/s it must earn) at which each pool's fleet is also a candidate: the
# staleness bound's budget of sequences priced, every price for all pools at once (see :meth:`Evaluator.fleets`).
PRICES = tuple(2.0**k for k in range(13))


@dataclass(frozen=True)
class Fleet:
    """The rollout replicas of a split: every pool's phase-1b solution together."""

    groups: tuple[tuple[ReplicaConfig, int], ...]
    optimal: bool

    @property
    def tokens_per_s(self) -> float:
        return sum(c.tokens_per_s * y for c, y in self.groups)


@dataclass(frozen=True)
class Evaluation:
    split: Split  # the machines its layouts occupy (those of the split scored, less any they leave empty)
    window: int  # delta(eta): training steps per weight update of the rollout servers (the runtime runs it)
    cost_per_hour: float
    train: TrainChoice | None
    fleet: Fleet  # every replica at its chosen in-flight cap (``concurrency``)
    train_s: float  # C_T (inf when no training layout fits)
    rollout_s: float  # generation + reward per step, with one KV rebuild per window (inf without rollout)
    sync_s: float  # one weight update, paid once per window
    reward_s: float
    shares: tuple[int, ...] = ()  # samples of each fleet group over one window (window x samples per step)
    loss: Loss | None = None  # expected losses of its preemptible machines (planner/preemption.py)

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.train_s) and math.isfinite(self.rollout_s)

    @property
    def c_t(self) -> float:
        return self.train_s

    @property
    def c_i(self) -> float:
        return self.rollout_s + self.sync_s / self.window

    @property
    def loss_free_step_s(self) -> float:
        return self.sync_s / self.window + max(self.rollout_s, self.train_s)

    @property
    def step_s(self) -> float:
        """Expected seconds per step: with the expected losses of preemptible machines, if any."""
        if self.loss is None:
            return self.loss_free_step_s
        return self.loss.step_s(self.sync_s / self.window, self.rollout_s, self.train_s)

    def tokens_per_s(self, tokens_per_step: float) -> float:
        return tokens_per_step / self.step_s if self.feasible else 0.0


@dataclass
class Evaluator:
    """Memoised phase-1 scoring of splits, shared by the two-phase search, the bound and the baselines."""

    cm: CostModel
    cluster: Cluster
    workload: WorkloadSpec
    solver: SolverConfig
    sync_strategy: str = "relay"
    caps: RuntimeCaps = PAPER  # the layouts the runtime can start (planner/caps.py)
    clocked: bool = True  # its work goes on the search's clock (planner/cpsat.py)
    preemption: Preemption | None = None  # preemptible pools: their losses priced, training kept off them
    _configs: dict[str, list[ReplicaConfig]] = field(default_factory=dict)
    _train: dict[tuple[int, ...], TrainChoice | None] = field(default_factory=dict)
    _pool_fleet: dict[tuple[str, int, float], RolloutSolution] = field(default_factory=dict)
    _fleets: dict[tuple[int, ...], list[Fleet]] = field(default_factory=dict)
    _runtimes: dict[Fleet, list[Runtime]] = field(default_factory=dict)
    _seen: dict[Split, Evaluation] = field(default_factory=dict)
    # Per-pool rate curves of the search's rate tables ((pool, kind, limit) -> count -> rate), once per solve.
    curves: dict[tuple[int, str, int], dict[int, float]] = field(default_factory=dict)
    # The search's repartitions ((request, deterministic limit) -> split and the work charged), once per solve.
    balances: dict[tuple, tuple[Split | None, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.inflight = InFlight(self.cm, self.clocked)
        self._charged = self.cm.estimates if self.clocked else 0

    def _charge(self) -> None:
        """Count the cost-model estimates computed since the last charge on the search's clock."""
        if self.clocked:
            charge((self.cm.estimates - self._charged) * ESTIMATE_WORK)
            self._charged = self.cm.estimates

    def at_eta(self, eta: int) -> Evaluator:
        """This evaluator under the staleness bound ``eta``, off the search's clock: it reads this one's memos of
        what eta does not change (training choices; replica shapes and pool fleets where both bounds are at least
        1; everything at its own eta) and keeps what it computes apart, so scoring on it changes neither this
        one's memos nor the work the search counts (``search``: steered at one eta, rescored at the recipe's)."""
        own = self.workload.rl.max_head_offpolicyness
        cm = self.cm.at_eta(eta)
        ev = Evaluator(
            cm,
            self.cluster,
            cm.workload,
            self.solver,
            self.sync_strategy,
            self.caps,
            clocked=False,
            preemption=self.preemption,
        )
        ev._train = ChainMap({}, self._train)
        if min(eta, own) >= 1:  # the same replica speeds, so the same candidate fleets
            ev._configs, ev._pool_fleet = ChainMap({}, self._configs), ChainMap({}, self._pool_fleet)
            ev._fleets = ChainMap({}, self._fleets)
        if eta == own:  # the same runtime choices
            ev._runtimes = ChainMap({}, self._runtimes)
        return ev

    @property
    def tokens_per_step(self) -> float:
        return self.workload.tokens_per_step

    def scored(self) -> list[Evaluation]:
        """Every split scored so far, in split order."""
        return [self._seen[split] for split in sorted(self._seen)]

    def scored_splits(self) -> dict[Split, Evaluation]:
        """Every split scored so far (as it was asked, not as its layouts occupy it) with its evaluation."""
        return self._seen

    def evaluate(self, split: Split) -> Evaluation:
        if split not in self._seen:
            self._seen[split] = self._evaluate(split)
            self._charge()
        return self._seen[split]

    def train(self, counts: tuple[int, ...]) -> TrainChoice | None:
        """Phase 1a on ``counts`` whole machines per pool."""
        return self.train_on(
            tuple(n * p.gpus_per_machine for p, n in zip(self.cluster.pools, counts, strict=True))
        )

    def train_on(self, gpus_per_pool: tuple[int, ...]) -> TrainChoice | None:
        """Phase 1a on these GPUs per pool (whole machines, and a shared machine's training part); memoised."""
        if gpus_per_pool not in self._train:
            pools = self.cluster.pools
            gpus = {p.name: n for p, n in zip(pools, gpus_per_pool, strict=True) if n}
            whole = all(n % p.gpus_per_machine == 0 for p, n in zip(pools, gpus_per_pool, strict=True))
            stages = self.caps.train_stages(self.solver.max_pp_stages)
            equal = self.caps.train_equal_stages and stages > 1
            allowed = self.preemption is None or self.preemption.may_train(gpus)
            self._train[gpus_per_pool] = (
                search_train(
                    self.cm,
                    self.cluster,
                    gpus,
                    stages,
                    equal_stages=equal,
                    # Hybrid sharding replicates over whole machines.
                    hybrid=self.caps.train_hybrid_sharding and whole,
                )
                if gpus and allowed
                else None
            )
            self._charge()
        return self._train[gpus_per_pool]

    def split_fleets(self, split: Split) -> list[Fleet]:
        """The candidate fleets of a split's rollout machines (:meth:`fleets`), each with the best replicas of its
        shared machines' rollout GPUs (:meth:`colocated_fleet`) added."""
        colocated = [
            self.colocated_fleet(p.name, n)
            for p, n in zip(self.cluster.pools, split.colocated_gpus(self.cluster), strict=True)
            if n
        ]
        if not colocated:
            return self.fleets(split.rollout)
        extra = tuple(g for s in colocated for g in s.counts)
        optimal = all(s.optimal for s in colocated)
        base = self.fleets(split.rollout) if any(split.rollout) else [Fleet((), True)]
        return [Fleet(f.groups + extra, f.optimal and optimal) for f in base]

    def colocated_fleet(self, pool_name: str, gpus: int) -> RolloutSolution:
        """Phase 1b on the ``gpus`` rollout GPUs of a pool's shared machine (one machine, so any replicas whose
        GPUs add up to at most ``gpus`` fit), as replicas marked ``colocated``; memoised."""
        key = (pool_name, -gpus, 0.0, 0.0)  # apart from the whole-machine fleets of _pool_fleet
        if key not in self._pool_fleet:
            configs = [replace(c, colocated=True) for c in self.replica_configs(pool_name) if c.gpus <= gpus]
            if self.caps.one_layout_per_pool:
                fleets = [solve_rollout([c], gpus) for c in configs] or [solve_rollout([], gpus)]
                self._pool_fleet[key] = max(fleets, key=lambda f: f.tokens_per_s)
            else:
                self._pool_fleet[key] = solve_rollout(configs, gpus)
        return self._pool_fleet[key]

    def fleets(self, counts: tuple[int, ...]) -> list[Fleet]:
        """Phase 1b: the candidate fleets of these rollout machines (every replica at its largest batch); memoised.
        Their runtime choices are :meth:`runtimes`.

        Every replica also rebuilds its KV cache after each weight update, which the linear objective
        sum(y_psi * h_psi) cannot see. So each pool's program is solved once per bound on that rebuild time, with
        only the shapes within the bound (a pool may do best with fast-rebuilding shapes while another needs
        speed).

        The staleness bound caps the sequences in flight over all replicas, and under that cap the best fleet may
        be another mix of shapes (fewer, larger replicas whose batches fit it). The program with that budget is
        the Lagrangian one: each sequence in flight priced at lambda, every shape at its best cap of the menu
        (value h(cap) - lambda * cap), each pool's knapsack solved alone; for every lambda of PRICES, all pools'
        fleets at it are one candidate.

        A pool's fleets of both programs are its candidates (:meth:`pool_candidates`): one pool may do best with
        a price fleet beside another's bound fleet. The candidates are every combination of the pools' fleets
        where there are at most ALL_COMBINATIONS, else those of :meth:`_descent_candidates`; the split's score
        picks the candidate and its runtime together. The candidates do not depend on eta.
        """
        if counts in self._fleets:
            return self._fleets[counts]
        pools = [(pool.name, n) for pool, n in zip(self.cluster.pools, counts, strict=True) if n]
        bounds = {name: self.bounds(name) for name, _ in pools}
        per_pool = [self.pool_candidates(name, n) for name, n in pools]
        if math.prod(len(p) for p in per_pool) <= ALL_COMBINATIONS:
            candidates = [_fleet_of(list(c)) for c in product(*per_pool)]
        else:
            candidates = self._descent_candidates(pools, bounds, per_pool)
        candidates += [_fleet_of([self.pool_fleet(name, n, price=p) for name, n in pools]) for p in PRICES]
        self._fleets[counts] = list({f: None for f in candidates if f.groups})
        self._charge()
        return self._fleets[counts]

    def bounds(self, pool_name: str) -> list[float]:
        """The KV-rebuild bounds of a pool's program: its shapes' rebuild times."""
        return sorted({c.recompute_s for c in self.replica_configs(pool_name)})

    def pool_candidates(self, pool_name: str, machines: int) -> list[RolloutSolution]:
        """A pool's distinct fleets on ``machines`` rollout machines: one per rebuild bound and one per price of
        an in-flight sequence (where that price leaves it any replica)."""
        solutions = [self.pool_fleet(pool_name, machines, b) for b in self.bounds(pool_name)]
        solutions += [self.pool_fleet(pool_name, machines, price=p) for p in PRICES]
        return list({s.counts: s for s in solutions if s.counts}.values())

    def runtimes(self, fleet: Fleet) -> list[Runtime]:
        """The runtime choices of a candidate fleet (:meth:`inflight.InFlight.runtimes`); memoised."""
        if fleet not in self._runtimes:
            reward_s = self.cm.reward_s(self.workload.rl.samples_per_step)
            self._runtimes[fleet] = self.inflight.runtimes(fleet.groups, reward_s)
            self._charge()
        return self._runtimes[fleet]

    def _descent_candidates(
        self,
        pools: list[tuple[str, int]],
        bounds: dict[str, list[float]],
        per_pool: list[list[RolloutSolution]],
    ) -> list[Fleet]:
        """The CANDIDATES fleets of one bound for every pool with the shortest makespan of a step with an update
        (at the replicas' largest batches), and the fleet that each pool's own candidates (``per_pool``) in turn
        reach from the best of them while that shortens the makespan."""
        samples = self.workload.rl.samples_per_step
        mean = self.workload.output_lengths.mean

        def makespan(solutions: list[RolloutSolution]) -> float:
            fleet = _fleet_of(solutions)
            return window_rollout_s(fleet.groups, samples, mean, updates=1) if fleet.groups else math.inf

        first: list[tuple[float, int, Fleet]] = []
        best, chosen = math.inf, []
        for i, bound in enumerate(sorted({b for v in bounds.values() for b in v})):
            solutions = [self.pool_fleet(name, n, bound) for name, n in pools]
            trial = makespan(solutions)
            first.append((trial, i, _fleet_of(solutions)))
            if trial < best:
                best, chosen = trial, solutions
        candidates = [f for _, _, f in sorted(first, key=lambda x: x[:2])[:CANDIDATES]]
        improved = bool(chosen)
        while improved:
            improved = False
            for i, own in enumerate(per_pool):
                for solution in own:
                    solutions = [*chosen[:i], solution, *chosen[i + 1 :]]
                    trial = makespan(solutions)
                    if trial < best * (1 - 1e-12):
                        best, chosen, improved = trial, solutions, True
        if chosen:
            candidates.append(_fleet_of(chosen))
        return candidates

    def replica_configs(self, pool_name: str) -> list[ReplicaConfig]:
        """Feasible replica shapes psi of a pool, dominated shapes removed (see :func:`prune_dominated`)."""
        if pool_name not in self._configs:
            self._configs[pool_name] = prune_dominated(self.feasible_shapes(pool_name))
        return self._configs[pool_name]

    def feasible_shapes(self, pool_name: str) -> list[ReplicaConfig]:
        """Every replica shape of a pool the runtime caps allow and the cost model says runs, deeper than
        ALL_DEPTHS stages only down to the shallowest depth where one runs (deeper pipelines are for memory)."""
        pool = self.cluster.pool(pool_name)
        configs: list[ReplicaConfig] = []
        for tp, pp in self.caps.rollout_shapes(
            pool.gpus_per_machine, self.solver.max_pp_stages, self.solver.rollout_layout
        ):
            if pp > ALL_DEPTHS and any(c.pp < pp for c in configs):
                break  # shapes come by depth
            config = self.replica_config(pool_name, tp, pp)
            if isinstance(config, ReplicaConfig):
                configs.append(config)
        return configs

    def replica_config(self, pool_name: str, tp: int, pp: int) -> ReplicaConfig | str:
        """The replica shape of ``pp`` stages of ``tp`` GPUs of a pool as the cost model estimates it, or why it
        does not run."""
        estimate = self.cm.rollout(tuple(RolloutStage(pool=pool_name, tp=tp) for _ in range(pp)))
        if not estimate.feasible or estimate.tokens_per_s <= 0:
            return estimate.reason or "it generates nothing"
        return ReplicaConfig(
            pool_name,
            tp,
            pp,
            estimate.tokens_per_s,
            estimate.concurrency,
            estimate.recompute_s,
            longest_s=estimate.longest_s,
            drain_s=estimate.drain_s,
        )

    def pool_fleet(
        self, pool_name: str, machines: int, max_recompute_s: float = math.inf, price: float = 0.0
    ) -> RolloutSolution:
        """Phase 1b on ``machines`` rollout machines of one pool (replicas never span pools), using only shapes
        that rebuild their KV cache within ``max_recompute_s``. With a ``price`` per sequence in flight, the
        fleet of most speed less price over every shape, each at its cap of the menu (``CAP_FRACTIONS`` of its
        batch) with the most; its replicas are returned at their largest batch (the runtime picks the caps)."""
        key = (pool_name, machines, max_recompute_s, price)
        if key not in self._pool_fleet:
            gpus = machines * self.cluster.pool(pool_name).gpus_per_machine
            configs = [c for c in self.replica_configs(pool_name) if c.recompute_s <= max_recompute_s]
            if price:  # dominance at the largest batch does not hold under a price: every shape
                configs = [c for c in self.feasible_shapes(pool_name) if c.recompute_s <= max_recompute_s]
                priced = {self._priced(c, price): c for c in configs}
                configs = [p for p in priced if p.tokens_per_s > 0]
            if self.caps.one_layout_per_pool:
                # Every server of the pool in one shape: the best fleet of each shape alone.
                fleets = [solve_rollout([c], gpus) for c in configs] or [solve_rollout([], gpus)]
                solution = max(fleets, key=lambda f: f.tokens_per_s)
            else:
                solution = solve_rollout(configs, gpus)
            if price:
                counts = tuple((priced[c], y) for c, y in solution.counts)
                solution = RolloutSolution(
                    counts, sum(c.tokens_per_s * y for c, y in counts), solution.optimal
                )
            self._pool_fleet[key] = solution
        return self._pool_fleet[key]

    def _priced(self, config: ReplicaConfig, price: float) -> ReplicaConfig:
        """``config`` worth its speed less ``price`` per sequence in flight, at its cap of the menu worth most."""
        caps = {max(1, int(config.concurrency * f)) for f in CAP_FRACTIONS}
        value = max(self.inflight.throttled(config, cap).tokens_per_s - price * cap for cap in caps)
        return replace(config, tokens_per_s=value)

    def rollout_floor(self, counts: tuple[int, ...]) -> float:
        """No split with these rollout machines has a shorter rollout time per step (:func:`rollout_floor`, at
        the fastest fleet phase 1b builds on them)."""
        speed = sum(
            self.pool_fleet(p.name, n).tokens_per_s
            for p, n in zip(self.cluster.pools, counts, strict=True)
            if n
        )
        rl = self.workload.rl
        return rollout_floor(
            speed,
            rl.samples_per_step,
            self.workload.output_lengths.mean,
            self.cm.reward_s(rl.samples_per_step),
        )

    def _evaluate(self, split: Split) -> Evaluation:
        train = self.train_on(split.train_gpus(self.cluster)) if split.trains() else None
        return self.score(split, train, self.split_fleets(split))

    def score(self, split: Split, train: TrainChoice | None, fleets: list[Fleet]) -> Evaluation:
        """The step of ``split`` with this training layout and the best of these candidate fleets, each at the
        runtime choices (window, in-flight caps) that make its step shortest; not memoised (:meth:`evaluate` is)."""
        samples = self.workload.rl.samples_per_step
        reward_s = self.cm.reward_s(samples)
        train_s = train.step_time_s if train else math.inf
        # Each training stage sends the layers it holds, from its own pool.
        senders = self.cm.senders(train.stages) if train else None
        rl = self.workload.rl
        widest = windows(rl.max_head_offpolicyness, rl.max_update_window)[-1]
        chosen: tuple[float, Fleet, Runtime, float] | None = None
        for fleet in fleets:
            sync_s = 0.0
            if senders is not None:
                replicas = [(replica_stages(c), y) for c, y in fleet.groups if not c.colocated]
                colocated = tuple(sorted({c.pool for c, _ in fleet.groups if c.colocated}))
                sync_s = self.cm.weight_sync(
                    senders, replicas, strategy=self.sync_strategy, colocated=colocated
                ).seconds
            # No runtime choice does better than all samples at full speed with the sync over the widest window:
            # where that is no shorter than the step found, the fleet's choices are not computed. The bound only
            # falls as eta grows, so no split scores worse with a larger eta.
            floor = rollout_floor(fleet.tokens_per_s, samples, self.workload.output_lengths.mean, reward_s)
            if chosen is not None and round(sync_s / widest + max(floor, train_s), 9) >= chosen[0]:
                continue
            runtime = choose(self.runtimes(fleet), train_s, sync_s)
            step = round(runtime.step_s(train_s, sync_s), 9)
            if chosen is None or step < chosen[0]:
                chosen = (step, Fleet(runtime.groups, fleet.optimal), runtime, sync_s)
        if chosen is None:
            fleet, window, rollout_s, sync_s = Fleet((), True), 1, math.inf, 0.0
        else:
            _, fleet, runtime, sync_s = chosen
            window, rollout_s = runtime.window, serial_rollout_s(runtime, train_s)
        shares = best_split(fleet.groups, samples * window, self.workload.output_lengths.mean)[1]
        if train and fleet.groups:
            split = occupied(self.cluster, train, fleet, split)
        return Evaluation(
            split=split,
            window=window,
            cost_per_hour=split.cost_per_hour(self.cluster),
            train=train,
            fleet=fleet,
            train_s=train_s,
            rollout_s=rollout_s,
            sync_s=sync_s if train else 0.0,
            reward_s=reward_s,
            shares=shares,
            loss=self.preemption.loss(train.estimate.gpus, fleet.groups)
            if self.preemption and train
            else None,
        )


def _fleet_of(solutions: list[RolloutSolution]) -> Fleet:
    return Fleet(tuple(g for s in solutions for g in s.counts), all(s.optimal for s in solutions))


def occupied(cluster: Cluster, train: TrainChoice, fleet: Fleet, split: Split | None = None) -> Split:
    """The machines the layouts occupy: a plan pays for these, not for machines its split left empty. A shared
    machine of ``split`` (the split scored) stays, with its GPUs split as there, where replicas run on it or
    training reaches into it (training fills its pool's whole training machines first)."""
    rollout_gpus: dict[str, int] = {}
    colocated: set[str] = set()
    for c, y in fleet.groups:
        rollout_gpus[c.pool] = rollout_gpus.get(c.pool, 0) + (0 if c.colocated else c.gpus * y)
        if c.colocated:
            colocated.add(c.pool)
    train_out, rollout_out, shared_out = [], [], []
    for i, p in enumerate(cluster.pools):
        g = split.shared_gpus(i) if split is not None else 0
        training = train.estimate.gpus.get(p.name, 0)
        if g and (p.name in colocated or training > split.train[i] * p.gpus_per_machine):
            train_out.append(split.train[i])
            shared_out.append(g)
        else:
            train_out.append(-(-training // p.gpus_per_machine))
            shared_out.append(0)
        rollout_out.append(-(-rollout_gpus.get(p.name, 0) // p.gpus_per_machine))
    return Split(tuple(train_out), tuple(rollout_out), tuple(shared_out))


def prune_dominated(configs: list[ReplicaConfig]) -> list[ReplicaConfig]:
    """Drop shapes that copies of another shape beat on both counts: if g' divides g, (g / g') * h' >= h and
    psi' rebuilds its KV cache after a weight update no slower, psi is useless.

    Shapes are visited by GPU count, then speed, then rebuild time, then pipeline depth, and only an earlier shape
    may dominate a later one, so exact ties keep the first.
    """
    order = sorted(configs, key=lambda c: (c.gpus, -c.tokens_per_s, c.recompute_s, c.pp))
    return [
        c
        for i, c in enumerate(order)
        if not any(
            c.gpus % o.gpus == 0
            and c.gpus // o.gpus * o.tokens_per_s >= c.tokens_per_s
            and o.recompute_s <= c.recompute_s
            and o.longest_s <= c.longest_s
            and o.drain_s <= c.drain_s
            for o in order[:i]
        )
    ]
