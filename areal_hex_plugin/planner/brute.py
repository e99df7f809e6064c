"""Brute force over the plan space of a small cluster, independent of the search: ``areal-hex plan --exhaustive``
and the checks of the two-phase search (tests, ``benchmarks/planner.py`` ``optimality``).

The space, within the evaluator's runtime caps (``planner/caps.py``), every part scored by the cost model alone:
- every machine split (train, rollout, idle per pool) within the budget, and where the search splits machines
  (``split.shared_choices``: small inventories) every split with a machine per pool shared between the roles at
  each of the search's GPU shares, its rollout GPUs holding every multiset of the shapes that fits them;
- training: the split's training pools in every order, each a block of k identical (dp, tp) stages, every k within
  the stage limit, every TP degree inside a machine and every dp that fits (the search fixes the order, takes the
  largest dp and cuts TP degrees); one stage may also be FSDP hybrid-sharded over whole machines, where the caps
  allow it; the cost model splits the layers (its split is checked against every composition in the tests);
- rollout (``planner/brute_rollout.py``): per pool every multiset of the replica shapes the caps allow whose
  GPUs fit its rollout machines (counting GPUs is an exact machine packing), each enumerated under the split whose
  rollout machines it occupies exactly; every update window delta <= eta + 1 and every in-flight cap of the
  runtime's menu (``inflight.InFlight.capped``; per-replica caps off the menu are not enumerated); the samples of
  a window split over the replicas by the best integer split (every group at least one sample), not in
  proportion to speed.

Reductions that are exact (no plan that could win is skipped), none of them the search's:
- the weight sync depends on a layout only through the bytes each pool sends and on a fleet only through the
  machines it occupies per pool: of the layouts that agree on that, only the fastest is scored in full, and the
  fleets of a split share one sync;
- a step is at least max(rollout, train), and training at least its FLOPs at every GPU's training MFU until a
  split's layouts are enumerated, rollout at least its samples at the fastest fleet's full speed: splits and
  layouts are visited best bound first, and those whose bound cannot beat the best plan found are counted, not
  scored;
- a fleet is scored at a window only if a relaxation says it might shorten the best step found
  (``brute_rollout.RolloutSide``).
The space grows as a product over pools, so exhaustive mode takes clusters within :data:`LIMITS` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import permutations, product

from areal_hex_plugin.costmodel import RolloutStage, TrainStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.bound import relaxation
from areal_hex_plugin.planner.brute_rollout import Multiset, Relaxed, RolloutSide, pool_fleets
from areal_hex_plugin.planner.evaluate import Evaluation, Evaluator, Fleet, occupied
from areal_hex_plugin.planner.inflight import Runtime, serial_rollout_s, windows
from areal_hex_plugin.planner.search import SearchResult
from areal_hex_plugin.planner.split import Split, all_splits, shared_choices
from areal_hex_plugin.planner.train_search import TrainChoice, tp_degrees

# The clusters exhaustive mode takes (each bounds a factor of the product the space grows as).
LIMITS = {"pools": 3, "machines per pool": 8, "GPUs per pool": 32, "hex.solver.max_pp_stages": 4}


@dataclass(frozen=True)
class Enumerated:
    """What one or more brute-force runs covered."""

    windows: int = 0
    splits: int = 0  # machine splits within the budget
    opened: int = 0  # of those, paired layout by fleet (the rest bounded out whole)
    layouts: int = 0  # feasible training layouts enumerated
    fleets: int = 0  # rollout fleets (replica multisets) of the opened splits' rollout machines
    fleets_scored: int = (
        0  # of those, scored at every window and cap with exact shares (the rest bounded out)
    )
    scored: int = 0  # (split, layout, fleet) plans scored in full

    def __add__(self, other: Enumerated) -> Enumerated:
        return Enumerated(
            *(a + b for a, b in zip(self.__dict__.values(), other.__dict__.values(), strict=True))
        )

    def describe(self) -> str:
        return (
            f"{self.splits:,} machine splits over {self.windows} window(s), {self.opened:,} of them opened "
            f"({self.layouts:,} feasible training layouts; {self.fleets:,} rollout fleets, every multiset of "
            f"replica shapes on their rollout machines, {self.fleets_scored:,} of them scored at every cap of the "
            f"runtime's menu with the best integer split of the samples) and {self.scored:,} plans scored in "
            "full; the rest bounded out exactly (a step is at least max(rollout, train), training at least its "
            "FLOPs at every GPU's training MFU, a fleet's window at least what a relaxation of its caps allows)"
        )


def check_size(ev: Evaluator, limits: tuple[int, ...]) -> None:
    """Refuse, naming the limit, a cluster the brute force would take too long on (HexError)."""
    pools = [(p, m) for p, m in zip(ev.cluster.pools, limits, strict=True) if m]
    sizes = {
        "pools": (len(pools), "pools"),
        "machines per pool": (max(m for _, m in pools), "machines in one pool"),
        "GPUs per pool": (max(m * p.gpus_per_machine for p, m in pools), "GPUs in one pool"),
        "hex.solver.max_pp_stages": (ev.solver.max_pp_stages, "pipeline stages allowed"),
    }
    for name, (value, what) in sizes.items():
        if value > LIMITS[name]:
            shown = ", ".join(f"{v} {k}" for k, v in LIMITS.items())
            raise HexError(
                "--exhaustive",
                f"this cluster has {value} {what}; exhaustive mode enumerates every plan of clusters of at most "
                f"{shown}",
                "drop --exhaustive (the two-phase search plans any size), or plan a smaller cluster",
            )


class BruteForce:
    """The brute force over one evaluator's cluster and caps; training layouts are enumerated once per machine
    counts and kept across runs (budgets, targets)."""

    def __init__(self, ev: Evaluator) -> None:
        self.ev = ev
        self._layouts: dict[tuple[int, ...], tuple[list[TrainChoice], int]] = {}
        self._pools: dict[tuple[str, int], list[Multiset]] = {}
        self._rollout: dict[tuple[int, ...], RolloutSide] = {}
        self._relaxed = Relaxed(ev.inflight, ev.workload.output_lengths.mean)
        self._relaxation = relaxation(ev)

    def exhaustive(
        self, limits: tuple[int, ...], budget: float | None, target: float | None = None
    ) -> tuple[SearchResult, Enumerated]:
        """The best plan over the space above: the fastest (then cheapest), or with ``target`` the cheapest
        reaching it."""
        check_size(self.ev, limits)
        best, done = self.run(limits, budget, target)
        return SearchResult(best, "optimal" if best else "infeasible", done.scored), done

    def run(
        self, limits: tuple[int, ...], budget: float | None, target: float | None = None
    ) -> tuple[Evaluation | None, Enumerated]:
        """The best plan of the space above (the fastest, then the cheapest; with ``target`` the cheapest
        reaching it, then the fastest), or None; and what was enumerated."""
        ev = self.ev
        splits = [
            s
            for s in all_splits(
                limits, shared_choices(ev.cluster, limits) if ev.caps.split_machines else None
            )
            if budget is None or s.cost_per_hour(ev.cluster) <= budget + 1e-9
        ]
        tokens = ev.tokens_per_step

        def bound(train_s: float, rollout_s: float, cost: float) -> tuple:
            return _objective(tokens / max(train_s, rollout_s), cost, target)

        ranked = []
        for s in splits:
            floor = self._rollout_side(s).floor
            if math.isfinite(floor):
                cost = s.cost_per_hour(ev.cluster)
                ranked.append((bound(self._train_floor(s.train_gpus(ev.cluster)), floor, cost), s, cost))
        ranked.sort(key=lambda x: (x[0], [-v for v in x[1].train + x[1].rollout + x[1].shared]), reverse=True)
        best: tuple[tuple, Evaluation] | None = None
        scored, opened, trains, sides = 0, 0, set(), set()
        for split_bound, split, cost in ranked:
            if best is not None and split_bound <= best[0]:
                break
            opened += 1
            train_gpus = split.train_gpus(ev.cluster)
            trains.add(train_gpus)
            sides.add(_side_key(ev, split))
            side = self._rollout_side(split)
            # The weight sync depends on a fleet only through the machines it occupies: these (and the shared
            # machines, whose rollout GPUs every fleet of the split occupies).
            machines = [
                (tuple(RolloutStage(p.name, p.gpus_per_machine) for _ in range(n)), 1)
                for p, n in zip(ev.cluster.pools, split.rollout, strict=True)
                if n
            ]
            colocated = tuple(p.name for i, p in enumerate(ev.cluster.pools) if split.shared_gpus(i))
            for train in self._train_layouts(train_gpus)[0]:
                if best is not None and bound(train.step_time_s, side.floor, cost) <= best[0]:
                    break
                scored += 1
                senders = ev.cm.senders(train.stages)  # each stage sends its layers from its pool
                sync_s = ev.cm.weight_sync(
                    senders, machines, strategy=ev.sync_strategy, colocated=colocated
                ).seconds
                chosen = side.choose(train.step_time_s, sync_s)
                if chosen is None:
                    break
                runtime, shares = chosen
                key = _objective(tokens / runtime.step_s(train.step_time_s, sync_s), cost, target)
                if best is None or key > best[0]:
                    best = (key, _evaluation(ev, split, train, runtime, sync_s, shares))
        counted = Enumerated(
            windows=len(windows(ev.workload.rl.max_head_offpolicyness, ev.workload.rl.max_update_window)),
            splits=len(splits),
            opened=opened,
            layouts=sum(self._layouts[t][1] for t in trains),
            fleets=sum(self._rollout[r].fleets for r in sides),
            fleets_scored=sum(self._rollout[r].visited for r in sides),
            scored=scored,
        )
        return (best[1] if best else None), counted

    def _pool_fleets(self, split: Split) -> list[list[Multiset]]:
        """Per pool with rollout machines, every fleet occupying exactly them (:func:`pool_fleets`); per shared
        machine, every fleet of colocated replicas on its rollout GPUs."""
        out = []
        pools = self.ev.cluster.pools
        for pool, n in zip(pools, split.rollout, strict=True):
            if n:
                if (pool.name, n) not in self._pools:
                    self._pools[pool.name, n] = pool_fleets(
                        self.ev.feasible_shapes(pool.name),
                        n,
                        pool.gpus_per_machine,
                        self.ev.caps.one_layout_per_pool,
                    )
                out.append(self._pools[pool.name, n])
        for pool, gpus in zip(pools, split.colocated_gpus(self.ev.cluster), strict=True):
            if gpus:
                if (pool.name, -gpus) not in self._pools:
                    shapes = [replace(c, colocated=True) for c in self.ev.feasible_shapes(pool.name)]
                    self._pools[pool.name, -gpus] = pool_fleets(
                        shapes, 1, gpus, self.ev.caps.one_layout_per_pool
                    )
                out.append(self._pools[pool.name, -gpus])
        return out

    def _rollout_side(self, split: Split) -> RolloutSide:
        key = _side_key(self.ev, split)
        if key not in self._rollout:
            self._rollout[key] = RolloutSide(self.ev, self._pool_fleets(split), self._relaxed)
        return self._rollout[key]

    def _train_layouts(self, gpus: tuple[int, ...]) -> tuple[list[TrainChoice], int]:
        if gpus not in self._layouts:
            self._layouts[gpus] = _layouts(self.ev, gpus)
        return self._layouts[gpus]

    def _train_floor(self, gpus: tuple[int, ...]) -> float:
        """No training layout on these GPUs steps faster: the step's FLOPs at every GPU's training MFU
        (``bound.relaxation``, per machine), or its fastest layout once enumerated."""
        if gpus in self._layouts:
            layouts = self._layouts[gpus][0]
            return layouts[0].step_time_s if layouts else math.inf
        pools = self.ev.cluster.pools
        rate = sum(
            r * n / p.gpus_per_machine
            for r, n, p in zip(self._relaxation.train_rate, gpus, pools, strict=True)
        )
        return 1 / rate if rate > 0 else math.inf


def _side_key(ev, split: Split) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a split's rollout side depends on: its rollout machines and its shared machines' rollout GPUs."""
    return split.rollout, split.colocated_gpus(ev.cluster)


def _objective(rate: float, cost: float, target: float | None) -> tuple:
    """Larger is better: the fastest, then the cheapest; with ``target`` the cheapest reaching it, then the
    fastest."""
    rate, cost = round(rate, 6), -round(cost, 6)
    return (rate >= target, cost, rate) if target is not None else (rate, cost)


def _evaluation(
    ev, scored: Split, train: TrainChoice, runtime: Runtime, sync_s: float, shares: tuple[int, ...]
) -> Evaluation:
    """The plan as the evaluator reports one: on the machines it occupies, at their price."""
    fleet = Fleet(runtime.groups, True)
    split = occupied(ev.cluster, train, fleet, scored)
    return Evaluation(
        split=split,
        window=runtime.window,
        cost_per_hour=split.cost_per_hour(ev.cluster),
        train=train,
        fleet=fleet,
        train_s=train.step_time_s,
        rollout_s=serial_rollout_s(runtime, train.step_time_s),
        sync_s=sync_s,
        reward_s=ev.cm.reward_s(ev.workload.rl.samples_per_step),
        shares=shares,
    )


def _layouts(ev: Evaluator, gpus_per_pool: tuple[int, ...]) -> tuple[list[TrainChoice], int]:
    """The fastest feasible layout on these training GPUs per pool for each assignment of layers to pools' stages
    (what the weight sync depends on), fastest first; and how many feasible layouts there are."""
    if not any(gpus_per_pool):
        return [], 0
    caps = ev.caps
    max_pp = caps.train_stages(ev.solver.max_pp_stages)
    pools = [p for p, n in zip(ev.cluster.pools, gpus_per_pool, strict=True) if n]
    gpus = {p.name: n for p, n in zip(ev.cluster.pools, gpus_per_pool, strict=True) if n}
    # Hybrid sharding replicates over whole machines.
    hybrid = caps.train_hybrid_sharding and all(gpus[p.name] % p.gpus_per_machine == 0 for p in pools)
    blocks = {p.name: _blocks(p, gpus[p.name], max_pp, hybrid) for p in pools}
    fastest: dict[tuple[tuple[str, float], ...], TrainChoice] = {}
    feasible = 0
    for size in range(1, (len(pools) if caps.train_mixed_types else 1) + 1):
        for order in permutations(pools, size):
            for choice in product(*(blocks[p.name] for p in order)):
                stages = tuple(
                    TrainStage(p.name, dp, tp, hybrid)
                    for p, (k, dp, tp, hybrid) in zip(order, choice, strict=True)
                    for _ in range(k)
                )
                if len(stages) > max_pp or (len(stages) > 1 and any(s.hybrid for s in stages)):
                    continue
                if caps.train_equal_stages and len({(s.dp, s.tp) for s in stages}) > 1:
                    continue
                estimate = ev.cm.train(stages)
                if not estimate.feasible:
                    continue
                feasible += 1
                # What each pool sends follows from its stages' layers (a finer key than the bytes: still exact).
                sent = tuple(zip((s.pool for s in stages), estimate.layers, strict=True))
                if sent not in fastest or estimate.step_time_s < fastest[sent].step_time_s:
                    fastest[sent] = TrainChoice(stages, estimate)
    return sorted(fastest.values(), key=lambda c: c.step_time_s), feasible


def _blocks(pool, gpus: int, max_pp: int, hybrid: bool) -> list[tuple[int, int, int, bool]]:
    """(k stages, dp, tp, hybrid) blocks of one pool within its GPUs; hybrid ones over two or more whole
    machines."""
    machine = pool.gpus_per_machine
    plain = [
        (k, dp, tp, False)
        for k in range(1, max_pp + 1)
        for tp in tp_degrees(machine)
        for dp in range(1, gpus // (k * tp) + 1)
    ]
    whole = [
        (1, m * machine // tp, tp, True)
        for tp in tp_degrees(machine)
        for m in range(2, gpus // machine + 1)
        if hybrid
    ]
    return plain + whole
