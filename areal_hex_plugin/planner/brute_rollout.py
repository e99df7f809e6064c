"""The brute force's rollout side (``planner/brute.py``): every fleet of a split's rollout machines, each at every
in-flight cap the runtime offers and every update window, with the best integer split of the samples.

A fleet is any multiset of the pool's replica shapes (``Evaluator.feasible_shapes``: every (tp, pp) the runtime
caps allow that the cost model says runs; one shape per pool where the runtime gives a pool one layout) whose GPUs
fit the pool's rollout machines. TP degrees divide the machine size and form a divisibility chain, so the
placement (``planner/machine_assignment.py``, largest first) packs any such multiset without splitting a stage across
machines: counting GPUs is exact. A fleet is enumerated under the split whose rollout machines it occupies
exactly (ceil(GPUs / machine size) per pool); a fleet that leaves whole machines empty is the same plan as under the
split without them, which the brute force also enumerates (and a plan pays only for the machines it occupies).

The rollout time of a fleet (``inflight.window_rollout_s``'s objective: per group, the busiest replica's
ceil(x / y) samples at the group's speed plus one KV rebuild per window) is minimised over every integer split
x_g >= 1 of the window's samples (``inflight.best_split``), not proportional shares. In-flight caps: the runtime's
menu of ``inflight.InFlight.capped`` (each fraction of ``CAP_FRACTIONS`` of every replica's batch, cut in
proportion to the sequences of every batch count the window admits); per-replica caps off that menu are not
enumerated.

Exact reductions (no fleet that could change a plan's step is skipped), none of them the search's:
- the weight sync depends on a fleet only through the machines it occupies per pool (``receiving_machines``), so
  per split and window only the fleet with the shortest rollout time matters;
- a fleet's rollout time per step, at any window and caps, is at least its samples at the replicas' full speed
  plus the reward (``inflight.rollout_floor``: a cap only slows a replica). Fleets are visited fastest first;
  once that floor reaches the best time found at the largest window W, no fleet left can be chosen at any window w:
  its step there, sync / w + max(rollout, train), is no shorter than the W one's (sync / w >= sync / W);
- a fleet the relaxation passes is scored only at the caps of its menu under which the samples' upper bound per
  group within the window time to beat (:func:`reaches`, ``best_split``'s own test) covers the window's samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from operator import itemgetter

from areal_hex_plugin.planner.inflight import (
    Groups,
    Runtime,
    ahead,
    best_split,
    choose,
    kind,
    rollout_floor,
    runtime_of,
    window_rollout,
    windows,
)
from areal_hex_plugin.planner.inflight import reaches as split_reaches
from areal_hex_plugin.planner.rollout_model import ReplicaConfig

Multiset = tuple[tuple[ReplicaConfig, int], ...]
# Prices of an in-flight sequence, in tokens, the relaxation of :class:`RolloutSide` tries.
PRICES = (0.0, *(2.0**k for k in range(17)))


def pool_fleets(
    shapes: list[ReplicaConfig], machines: int, per_machine: int, one_shape: bool
) -> list[Multiset]:
    """Every multiset of ``shapes`` that occupies exactly ``machines`` machines of ``per_machine`` GPUs (one
    shape only with ``one_shape``), fastest (sum of replica speeds) first."""
    low, high = (machines - 1) * per_machine, machines * per_machine
    out: list[Multiset] = []

    def extend(i: int, gpus: int, chosen: list[tuple[ReplicaConfig, int]]) -> None:
        if i == len(shapes):
            if gpus > low:
                out.append(tuple(chosen))
            return
        shape = shapes[i]
        most = (high - gpus) // shape.gpus if not (one_shape and chosen) else 0
        for k in range(most, -1, -1):
            extend(i + 1, gpus + k * shape.gpus, [*chosen, (shape, k)] if k else chosen)

    extend(0, 0, [])
    return sorted(out, key=lambda f: -speed(f))


class Relaxed:
    """Per replica shape, a bound on the samples' tokens one replica generates within a window of T seconds, in
    flight sequences priced at lambda: g(T, lambda) = max over caps c of mean * k(c) - lambda * c plus lambda,
    k(c) = floor((T - r(c)) * h(c) / mean) the most samples it finishes at cap c (none before its longest sample
    ends, T < l(c) + r(c), where the window waits for it), c from 1 to its largest batch
    (see :class:`RolloutSide`)."""

    def __init__(self, inflight, mean_tokens: float) -> None:
        self.inflight = inflight
        self.mean = mean_tokens
        self._curves: dict[ReplicaConfig, list[tuple[float, float]]] = {}
        self._tokens: dict[tuple[ReplicaConfig, float, float], float] = {}

    def tokens(self, shape: ReplicaConfig, window_s: float, price: float) -> float:
        """The relaxed tokens of ``shape`` within ``window_s`` at ``price`` (the window's steps overlap their
        longest samples: ``inflight.as_run``)."""
        key = (shape, window_s, price)
        if key not in self._tokens:
            if shape not in self._curves:
                self._curves[shape] = [
                    (c.tokens_per_s, c.recompute_s)
                    for c in (self.inflight.throttled(shape, cap) for cap in range(1, shape.concurrency + 1))
                ]
            mean = self.mean
            # The float k is rounded up by a hair, so that rounding never drops a sample it finishes.
            self._tokens[key] = price + max(
                (mean * math.floor((window_s - r) * h / mean + 1e-9) if window_s >= r else 0.0) - price * c
                for c, (h, r) in enumerate(self._curves[shape], 1)
            )
        return self._tokens[key]


class RolloutSide:
    """The fleets on one rollout machine count, visited as far as a step needs them: per window the fastest
    (runtime, shares) of the fleets visited so far.

    A fleet is visited only if it might shorten a step (:meth:`choose`), which a relaxation tests. Within a window
    of T seconds replica i finishes n_i <= k_i = floor((T - r_i) * h_i / mean) samples at its cap c_i (its group's
    time, ceil(x / y) * mean / h + r, is within T), and the menu's caps
    hold at most S + R sequences (S those of the most batches the window admits, R replicas: the cut rounds each
    down but not below 1). So for every price lambda >= 0, samples * mean <= sum_i g_i(T, lambda) + lambda * S
    (:class:`Relaxed`: each replica at its own best cap, the menu dropped); a fleet for which one lambda falls
    short at the T a step needs cannot reach it. The lambda tested is the one most selective at the best fleet
    found. Per window, the T up to which every fleet passing the test has been visited is kept.
    """

    def __init__(self, ev, per_pool: list[list[Multiset]], relaxed: Relaxed) -> None:
        self.ev = ev
        rl = ev.workload.rl
        self._mean = ev.workload.output_lengths.mean
        self._reward = ev.cm.reward_s(rl.samples_per_step)
        self._windows = windows(rl.max_head_offpolicyness, rl.max_update_window)
        batches = range(1, rl.max_head_offpolicyness + 2)
        self._sequences = {m: ev.cm.staleness_sequences(m) for m in batches}
        self._per_pool = per_pool
        # Per pool its replica shapes, and each multiset as (shape index, count) pairs.
        self._shapes = [list(dict.fromkeys(c for f in fleets for c, _ in f)) for fleets in per_pool]
        self._indexed = []
        for shapes, fleets in zip(self._shapes, per_pool, strict=True):
            index = {c: i for i, c in enumerate(shapes)}
            self._indexed.append([tuple((index[c], y) for c, y in f) for f in fleets])
        self._relaxed = relaxed
        self._certified: dict[int, float] = {}
        self._seen: set[tuple[int, Multiset]] = set()  # (window, fleet) scored
        self._menus: dict[
            Multiset, list[list[tuple[int, ...]]]
        ] = {}  # per fleet, per batch count m, its caps
        self._version = 0  # counts changes of ``best`` and ``_certified``, which ``_test`` depends on
        self._tests: dict = {}
        self.fleets = math.prod(len(p) for p in per_pool) if per_pool else 0
        # window -> (runtime, samples per group over the window, the fleet before caps)
        # (window, kind) -> (runtime, samples per group over the window, the fleet before caps): inflight.kind
        self.best: dict[tuple[int, float | None], tuple[Runtime, tuple[int, ...], Multiset]] = {}

    @property
    def visited(self) -> int:
        """Fleets scored at some window."""
        return len({fleet for _, fleet in self._seen})

    def _floor(self, tokens_per_s: float) -> float:
        return rollout_floor(tokens_per_s, self.ev.workload.rl.samples_per_step, self._mean, self._reward)

    @property
    def floor(self) -> float:
        """No fleet here has a shorter rollout time per step, at any window: the fastest at full speed."""
        if not self.fleets:
            return math.inf
        return self._floor(sum(speed(fleets[0]) for fleets in self._per_pool))

    def choose(self, train_s: float, sync_s: float) -> tuple[Runtime, tuple[int, ...]] | None:
        """The runtime with the shortest step beside a training step of ``train_s`` and a weight sync of
        ``sync_s`` (``inflight.choose`` over the windows), and its shares over the window; None if no fleet runs.

        Every fleet that might shorten the best step found at some window w is visited: its step there,
        sync / w + max(rollout, train), must be below the best, so its window time below
        T_w = (best - sync / w - reward) * w, which the relaxation tests.
        """
        if not self.fleets:
            return None
        if not self.best:
            fastest = tuple(g for fleets in self._per_pool for g in fleets[0])
            for window in self._windows:
                self._visit(fastest, window)
        if not self.best:
            return None
        for window in self._windows:
            while (test := self._test(window, train_s, sync_s)) is not None:
                # First the fleet with the most relaxed tokens, while that is new: a good incumbent.
                top = tuple(
                    g
                    for p, fleets in enumerate(self._per_pool)
                    for g in fleets[max(range(len(fleets)), key=test[0](p).__getitem__)]
                )
                if (window, top) in self._seen or not test[1](top):
                    break
                self._visit(top, window)
            test = self._test(window, train_s, sync_s)
            if test is None:
                continue
            window_s = self._window_s(window, train_s, sync_s)
            for fleet in self._candidates(*test):
                if (
                    (window, fleet) not in self._seen
                    and (now := self._test(window, train_s, sync_s))
                    and now[1](fleet)
                ):
                    self._visit(fleet, window, now[3])
            self._certified[window] = window_s
            self._version += 1
        runtime = choose([r for r, _, _ in self.best.values()], train_s, sync_s)
        return runtime, self.best[(runtime.window, kind(runtime))][1]

    def _window_s(self, window: int, train_s: float, sync_s: float) -> float | None:
        """The window time below which a fleet would shorten the best step at ``window``; None when none can or
        every fleet that can has been visited."""
        step = min(r.step_s(train_s, sync_s) for r, _, _ in self.best.values())
        limit = step - sync_s / window
        window_s = (limit - self._reward) * window
        if train_s >= limit or window_s <= self._certified.get(window, -math.inf):
            return None
        return window_s

    def _test(self, window: int, train_s: float, sync_s: float):
        """(relaxed tokens of a pool's or whole fleet, whether a fleet passes, the tokens it needs, the window
        time to beat) at the best step found so far; None when no fleet left can shorten it at ``window``.
        Kept until the best runtimes or the certified windows change."""
        key = (window, train_s, sync_s, self._version)
        if key not in self._tests:
            self._tests = {key: self._new_test(window, train_s, sync_s)}
        return self._tests[key]

    def _new_test(self, window: int, train_s: float, sync_s: float):
        window_s = self._window_s(window, train_s, sync_s)
        if window_s is None:
            return None
        rl = self.ev.workload.rl
        have = self._sequences[rl.max_head_offpolicyness + 2 - window]
        need = rl.samples_per_step * window * self._mean
        incumbent = min(self.best.values(), key=lambda b: b[0].rollout_s)[2]
        tokens = partial(self._relaxed.tokens, window_s=window_s)

        def bound(fleet: Multiset, price: float) -> float:
            return sum(tokens(c, price=price) * y for c, y in fleet) + price * have

        price = min(PRICES, key=lambda p: bound(incumbent, p))
        weights = {c: tokens(c, price=price) for shapes in self._shapes for c in shapes}
        scores: dict[int, list[float]] = {}

        def pool_tokens(p: int) -> list[float]:
            """Relaxed tokens of each of pool p's multisets."""
            if p not in scores:
                w = [weights[c] for c in self._shapes[p]]
                scores[p] = [sum(w[i] * y for i, y in multiset) for multiset in self._indexed[p]]
            return scores[p]

        def passes(fleet: Multiset) -> bool:
            return sum(weights[c] * y for c, y in fleet) + price * have >= need

        return pool_tokens, passes, need - price * have, window_s

    def _candidates(self, pool_tokens, passes, need: float, window_s: float) -> Iterator[Multiset]:
        """The fleets whose relaxed tokens reach ``need`` (a sum over pools: each pool's multisets by their
        relaxed tokens, cut where even the best of the other pools falls short, with a relative 1e-9 of slack
        for the order of float sums)."""
        need -= 1e-9 * abs(need)
        per_pool = [
            sorted(zip(pool_tokens(p), fleets, strict=True), key=itemgetter(0), reverse=True)
            for p, fleets in enumerate(self._per_pool)
        ]
        rest = [0.0] * (len(per_pool) + 1)  # the most the pools from p on can add
        for p in reversed(range(len(per_pool))):
            rest[p] = rest[p + 1] + per_pool[p][0][0]

        def walk(p: int, have: float, chosen: tuple) -> Iterator[Multiset]:
            if p == len(per_pool):
                yield chosen
                return
            for total, f in per_pool[p]:
                if have + total + rest[p + 1] < need:
                    break
                yield from walk(p + 1, have + total, chosen + f)

        yield from walk(0, 0.0, ())

    def _visit(self, fleet: Multiset, window: int, window_s: float = math.inf) -> None:
        """Score one fleet at one window, at every cap of the menu the window admits, with exact shares; caps
        under which not even the best split finishes the window's samples within ``window_s`` are not scored
        (:func:`reaches`: exact, so they could not shorten the step the window time comes from)."""
        self._seen.add((window, fleet))
        rl = self.ev.workload.rl
        samples = rl.samples_per_step * window
        # The caps of each fraction cut to m batches' sequences, m up to the ahead(eta, window) the window keeps.
        menus = self._menus.setdefault(fleet, [])
        for m in range(len(menus) + 1, ahead(rl.max_head_offpolicyness, window) + 1):
            menus.append(
                tuple(
                    self.ev.inflight.caps(fleet, f, self._sequences[m]) for f in self.ev.inflight.fractions()
                )
            )
        menu = dict.fromkeys(c for caps in menus[: ahead(rl.max_head_offpolicyness, window)] for c in caps)
        for caps in menu:
            capped = self.ev.inflight.as_run(self.ev.inflight.throttle(fleet, caps), window)
            held = runtime_of(self.ev.cm, capped, window, math.inf)
            known = self.best.get((held.window, kind(held)))
            if known and self._floor(speed(capped)) >= known[0].rollout_s:
                continue
            if not reaches(capped, samples, self._mean, window_s):
                continue
            makespan, shares = best_split(capped, samples, self._mean)
            eta = rl.max_head_offpolicyness
            rollout = window_rollout(capped, makespan, window, eta, self._reward)
            if known is None or rollout < known[0].rollout_s:
                self.best[(held.window, kind(held))] = (replace(held, rollout_s=rollout), shares, fleet)
                self._version += 1


def reaches(groups: Groups, samples: int, mean_tokens: float, window_s: float) -> bool:
    """Whether some split of ``samples`` (every group at least one) finishes within ``window_s`` with one KV
    rebuild per replica (``inflight.reaches``, the test ``best_split`` bisects with; any split within no bound)."""
    return math.isinf(window_s) or split_reaches(groups, samples, mean_tokens, window_s)


def speed(groups: Groups) -> float:
    """Tokens/s of every replica together."""
    return sum(c.tokens_per_s * y for c, y in groups)
