"""The rollout side's runtime decisions under the staleness bound eta: the update window and the in-flight caps.

Upstream pushes new weights to the rollout servers after every training step: generation pauses for the weight
sync, and every in-flight request is aborted and resubmitted, so each replica prefills its whole in-flight context
again (``RolloutEstimate.recompute_s``). Pushing every delta steps instead (the window delta(eta), which the
driver runs) pays both once per delta steps. The price is staleness, and a pipeline that may drain: upstream admits
a rollout only while (eta + v + 1) consumer batches cover every rollout accepted or running, v the version of the
rollout servers' weights, so the room grows by delta batches at each update and not in between. Besides the
window's delta batches, eta + 1 - delta more may be admitted before its update, and at most that many run
(:func:`ahead`). With none (delta = eta + 1) the trainer's last step of the window needs every admitted rollout:
admission stops, the pipeline drains until the longest sample ends (no request is left to interrupt), the last
step trains with nothing generating, and the next window starts empty, its first batch waiting for its longest
sample and, where a replica's share of it exceeds its in-flight cap, the samples queued beyond the cap
(:func:`first_batch_s`). With one, the batch trained last and the one generating meanwhile cannot both be
admitted and the same happens. Such windows (:func:`drains`) pay for it (``RolloutEstimate.drain_s``, :func:`serial_rollout_s`); the
planner ignored it before, and the simulator (``sim/engine.py``: upstream's ``StalenessManager`` with the driver's
versions) was 15 to 28% slower than the plans of the paper and mixed recipes, which chose delta = eta + 1.

The in-flight cap of each replica (its decode batch; upstream's ``max_concurrent_rollouts`` over all of them)
trades decode speed (larger batches) against the KV cache rebuilt after each update (proportional to the batch),
and together the caps fit the sequences the staleness bound admits.

Both are chosen per split, exactly over every window :func:`windows` allows and the caps ``CAP_FRACTIONS`` of each
replica's largest batch (cut in proportion to the sequences of every batch count the window admits). A larger
eta only adds choices, so no split scores worse with a larger eta.

Where a window does not drain (and eta >= 1), its steps do not wait for their longest samples: upstream's loop
overlaps them with the next steps' rollouts as far as admission's room during training lets it
(``costmodel.model.admission_room``). A rollout that ends while the trainer trains stays accepted until the next
batch is taken, so it counts against the (eta + v + 1) batches upstream admits. With room for a whole batch beyond
the rollouts in flight, every rollout that ends is replaced and a step takes its samples at the fleet's rate
(Little's law). With less, the rollouts that end beyond the room are not replaced, and the window's last step
waits for what its batch then lacks (``costmodel.model.tight_step_s``, :func:`serial_rollout_s`; its wait depends
on the training time, so :meth:`InFlight.runtimes` keeps the best caps of either kind). This is the one runtime:
the baseline fit prices the measured runs with it too (:func:`held_rollout_s`). AReaL's released runtime on 24
H800 (7B, one batch admitted; the paper measured 419 s a step) is planned at 381 s a step at eta 1 and 329 s at
eta 8, simulated at 406 s and 368 s (``tests/sim/test_overlap.py``: the simulated replicas idle as their queues run
dry in each step's tail, which the plan does not see).

A fleet's rollout time per step is at least ``rollout_floor``: its samples at the replicas' full speed (a cap
only slows a replica), without the integer shares, the KV rebuilds or the weight sync.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, replace
from itertools import chain

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.costmodel.model import admission_room, tight_step_s
from areal_hex_plugin.planner.cpsat import charge
from areal_hex_plugin.planner.rollout_model import ReplicaConfig, largest_remainder

# In-flight caps tried, as fractions of each replica's largest batch (KV capacity, CUDA-graph limit).
CAP_FRACTIONS = (1.0, 0.75, 0.5, 0.375, 0.25, 0.125, 0.0625)

# Work charged per (window, caps) choice scored (the search's clock, planner/cpsat.py).
SCORE_WORK = 2e-5

Groups = tuple[tuple[ReplicaConfig, int], ...]


@dataclass(frozen=True)
class Runtime:
    """One choice of the runtime settings for a fleet."""

    window: int  # delta: training steps per weight update of the rollout servers
    groups: Groups  # the replicas, each config at its chosen in-flight cap (``concurrency``)
    rollout_s: float  # per step: generation and one KV rebuild over the window (and its drain), plus reward
    drained: bool = False  # the pipeline drains before each update (:func:`drains`)
    batches: float = 0.0  # consumer batches of rollouts in flight
    room: float = math.inf  # batches admission may replace during the window's last training (< 1: tight)
    fill_s: float = 0.0  # where it drains: its first batch from empty (:func:`first_batch_s`)

    def step_s(self, train_s: float, sync_s: float) -> float:
        """The step with one weight sync of ``sync_s`` per window."""
        return sync_s / self.window + max(serial_rollout_s(self, train_s), train_s)


def serial_rollout_s(runtime: Runtime, train_s: float) -> float:
    """The rollout seconds per step the trainer waits through. Where the window drains, each window starts empty
    and nothing overlaps its ends: the last step trains after the drain (no room is left to generate until the
    update), and the first waits for its batch from empty (:func:`first_batch_s`), so a window takes at least its
    generation, drain and one training step, and at least its training and that first wait. Where admission
    cannot replace a batch during the window's last training (``room`` < 1), that step waits for what its batch
    lacks (``tight_step_s``)."""
    if not runtime.drained:
        if runtime.room >= 1:
            return runtime.rollout_s
        last = tight_step_s(runtime.rollout_s, train_s, runtime.batches, runtime.room)
        return ((runtime.window - 1) * max(runtime.rollout_s, train_s) + last) / runtime.window
    return max(runtime.rollout_s + train_s / runtime.window, train_s + runtime.fill_s / runtime.window)


def windows(eta: int, most: int = 0) -> range:
    """The update windows the staleness bound eta allows (at least one batch may run ahead at every version), at
    most ``most`` (0: no other limit)."""
    return range(1, min(eta + 1, most or eta + 1) + 1)


def ahead(eta: int, window: int) -> int:
    """Consumer batches of rollouts that may be in flight under ``window``: the eta + 1 - window its updates leave
    room for besides the window's own, at least one."""
    return max(1, eta + 1 - window)


def drains(eta: int, window: int) -> bool:
    """Whether the pipeline drains before each update of ``window``: at eta = 0 every step's generation ends
    before the trainer takes its batch and the next may start only after the update; from eta = 1 where fewer
    than two batches of room are left beyond the window (a window of one step waits for its longest sample
    already)."""
    return eta == 0 or (window >= 2 and eta <= window)


def runtime_of(cm: CostModel, groups: Groups, window: int, rollout_s: float, admitted: int = 0) -> Runtime:
    """The :class:`Runtime` of ``groups`` over ``window`` at ``rollout_s`` per step, with its admission room."""
    rl = cm.workload.rl
    if admitted:
        batches = cm.batches_admitted(admitted)
    else:
        batches = cm.batches_in_flight(sum(c.concurrency * y for c, y in groups))
    eta = rl.max_head_offpolicyness
    room = admission_room(eta, window, batches)
    drained = drains(eta, window)
    fill = first_batch_s(groups, rl.samples_per_step, cm.workload.output_lengths.mean) if drained else 0.0
    return Runtime(window, groups, rollout_s, drained, batches, room, fill)


def first_batch_s(groups: Groups, samples: int, mean_tokens: float) -> float:
    """Seconds the first batch of ``samples`` of a window that drains takes: the window starts empty, so each
    replica (as :func:`as_run` gives it: its longest sample ``longest_s + drain_s``) generates its share of the
    batch from nothing, split in proportion to speed. Up to its cap the share runs at once and ends with its
    longest sample; the samples beyond the cap enter as slots free, at the replica's rate, before the last of them
    starts its longest sample."""
    parts = largest_remainder(samples, [c.tokens_per_s * y for c, y in groups])
    return max(
        (
            c.longest_s + c.drain_s + max(0, -(-x // y) - c.concurrency) * mean_tokens / c.tokens_per_s
            for (c, y), x in zip(groups, parts, strict=True)
        ),
        default=0.0,
    )


def as_run(cm: CostModel, groups: Groups, window: int) -> Groups:
    """``groups`` as ``window``'s generation sees them, each replica's ``longest_s`` what its window's samples end
    no earlier than. Where the window drains, the work its batch in flight has left (``CostModel.batch_work_s``):
    the longest sample outlasts it by the drain, which :func:`window_rollout` adds once. Else (eta >= 1) none: a
    step's wait for what admission could not replace during training is :func:`serial_rollout_s`'s."""
    rl = cm.workload.rl
    if drains(rl.max_head_offpolicyness, window):
        return tuple(
            (replace(c, longest_s=min(c.longest_s, cm.batch_work_s(c.tokens_per_s, c.concurrency))), y)
            for c, y in groups
        )
    return tuple((replace(c, longest_s=0.0), y) for c, y in groups)


def held_runtime(
    cm: CostModel, groups: Groups, window: int, even: bool = False, admitted: int = 0
) -> Runtime:
    """The runtime of ``groups`` held at their caps over ``window`` (and ``admitted`` rollouts, :func:`as_run`),
    scored as :meth:`InFlight.runtimes` scores a choice (``even``: the window's samples split evenly over the
    replicas instead)."""
    rl = cm.workload.rl
    run = as_run(cm, groups, window)
    samples = rl.samples_per_step * window
    mean = cm.workload.output_lengths.mean
    if even:
        makespan = window_rollout_s(run, samples, mean, updates=1, even=True)
    else:
        makespan = best_split(run, samples, mean)[0]
    eta = rl.max_head_offpolicyness
    per_step = window_rollout(run, makespan, window, eta, cm.reward_s(rl.samples_per_step))
    return runtime_of(cm, run, window, per_step, admitted)


def held_rollout_s(cm: CostModel, groups: Groups, window: int, admitted: int, train_s: float) -> float:
    """The rollout seconds per step the trainer waits through with ``groups`` held at their caps, ``admitted``
    rollouts admitted at once (``max_concurrent_rollouts``) and a weight update every ``window`` steps, beside a
    training step of ``train_s``: upstream 1.0.4's loop as every caller prices it (the plan's own choice, a held
    plan, the baseline fit and the measured runs of ``reproduce``)."""
    return serial_rollout_s(held_runtime(cm, groups, window, admitted=admitted), train_s)


def window_rollout(groups: Groups, makespan: float, window: int, eta: int, reward_s: float) -> float:
    """Rollout seconds per step of a window whose samples take ``makespan`` on ``groups``, with the drain before
    each update where it drains (the longest of the replicas' ``drain_s``; none without replicas)."""
    drain = max((c.drain_s for c, _ in groups), default=0.0) if drains(eta, window) else 0.0
    return (makespan + drain) / window + reward_s


def replica_stages(config: ReplicaConfig) -> tuple[RolloutStage, ...]:
    return tuple(RolloutStage(pool=config.pool, tp=config.tp) for _ in range(config.pp))


def window_rollout_s(
    groups: Groups, samples: int, mean_tokens: float, updates: int = 0, even: bool = False
) -> float:
    """Generation makespan of ``samples`` samples split by largest remainder in proportion to y_psi * h_psi
    (``even``: to y_psi, the same number per replica), with each replica rebuilding its KV cache after each of
    ``updates`` weight updates."""
    weights = [y if even else c.tokens_per_s * y for c, y in groups]
    parts = largest_remainder(samples, weights)
    return max(
        replica_time(c, math.ceil(x / y), mean_tokens, updates)
        for (c, y), x in zip(groups, parts, strict=True)
    )


def split_floor(groups: Groups, samples: int, mean_tokens: float, updates: int = 1) -> float:
    """No split of ``samples`` samples over the groups has a shorter makespan than this (:func:`best_split`'s): the
    samples split continuously, group g finishing (T - updates * r_g) * h_g * y_g / mean of them by T; and every
    group, holding at least one sample, waits for its longest."""
    speed = sum(c.tokens_per_s * y for c, y in groups)
    relaxed = (
        samples * mean_tokens + sum(updates * c.recompute_s * c.tokens_per_s * y for c, y in groups)
    ) / speed
    return max(relaxed, min(c.longest_s + updates * c.recompute_s for c, _ in groups))


def replica_time(c: ReplicaConfig, k: int, mean_tokens: float, updates: int) -> float:
    """A replica's time for ``k`` samples, to the last bit: its tokens at its rate, but no earlier than the
    window's longest sample ends (the window's steps overlap their tails), plus one KV rebuild per update."""
    if k <= 0:
        return updates * c.recompute_s
    return max(k * mean_tokens / c.tokens_per_s, c.longest_s) + updates * c.recompute_s


def _most(c: ReplicaConfig, t: float, mean_tokens: float, updates: int) -> int:
    """The most samples a replica finishes within ``t``."""
    if t < c.longest_s + updates * c.recompute_s:
        return 0
    k = max(0, int((t - updates * c.recompute_s) * c.tokens_per_s / mean_tokens))
    while replica_time(c, k + 1, mean_tokens, updates) <= t:
        k += 1
    while k > 0 and replica_time(c, k, mean_tokens, updates) > t:
        k -= 1
    return k


def reaches(groups: Groups, samples: int, mean_tokens: float, t: float, updates: int = 1) -> bool:
    """Whether some split of ``samples`` (every group at least one) finishes within ``t``: the most each group
    finishes within it, all at least one, sum to at least ``samples``."""
    counts = [_most(c, t, mean_tokens, updates) for c, _ in groups]
    return min(counts) >= 1 and sum(k * y for k, (_, y) in zip(counts, groups, strict=True)) >= samples


def best_split(
    groups: Groups, samples: int, mean_tokens: float, updates: int = 1
) -> tuple[float, tuple[int, ...]]:
    """The shortest makespan of ``samples`` samples over the groups, every group at least one sample: group g's
    busiest replica takes ceil(x_g / y_g) samples and rebuilds its KV cache ``updates`` times; and the x_g.

    Exact: a group's time only grows with its samples, so a makespan T is reachable iff the largest sample counts
    each group finishes within T (y_g times the most k with k * mean / h_g + updates * r_g <= T) sum to at least
    ``samples`` and are all at least one (:func:`reaches`). The optimum is one of the group times, the smallest
    reachable one.
    """
    if samples < len(groups) or not groups:
        return math.inf, ()

    def time(g: int, k: int) -> float:
        return replica_time(groups[g][0], k, mean_tokens, updates)

    # The optimum lies between the relaxation's makespan (samples split continuously) and that of one split with
    # every group at least one sample (the rest in proportion to speed): only the group times in between are
    # candidates, a few per group however many the samples, and reaching them is monotone in time.
    low = split_floor(groups, samples, mean_tokens, updates)
    rest = largest_remainder(samples - len(groups), [c.tokens_per_s * y for c, y in groups])
    high = max(time(g, -(-(x + 1) // y)) for g, ((_, y), x) in enumerate(zip(groups, rest, strict=True)))
    tops = [_most(c, high, mean_tokens, updates) for c, _ in groups]

    def first(g: int) -> int:
        """The first candidate sample count of group g: up to ``flat`` samples it waits for its longest sample
        alone (one time for them all), and none below the floor's count."""
        c = groups[g][0]
        flat = int(c.longest_s * c.tokens_per_s / mean_tokens)
        return max(1, _most(c, low, mean_tokens, updates), min(flat, tops[g]))

    firsts = [first(g) for g in range(len(groups))]
    if len(groups) == 1:
        # One group reaches T iff its replicas each finish ``need`` samples by T: that count's time is the least
        # candidate that reaches, and the group takes every sample.
        need = -(-samples // groups[0][1])
        if firsts[0] <= need <= tops[0]:
            return time(0, need), (samples,)
    # Group g's candidate times, sample counts firsts[g] .. tops[g]: no time up to ``high`` lets it finish more
    # than tops[g], so the most it finishes within a time from its first candidate on is a count of these.
    own = [_times(c, a, b, mean_tokens, updates) for (c, _), a, b in zip(groups, firsts, tops, strict=True)]

    def most(g: int, t: float) -> int:
        """:func:`_most` of group g, for times up to ``high``."""
        if own[g] and t >= own[g][0]:
            return firsts[g] - 1 + bisect_right(own[g], t)
        return _most(groups[g][0], t, mean_tokens, updates)

    def reached(t: float) -> bool:
        """:func:`reaches` for times up to ``high``."""
        counts = [most(g, t) for g in range(len(groups))]
        return min(counts) >= 1 and sum(k * y for k, (_, y) in zip(counts, groups, strict=True)) >= samples

    times = sorted(chain.from_iterable(own))
    lo, hi = 0, len(times) - 1  # times[hi] is reachable: at most high, and the group reaching high has it
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reached(times[mid]) else (mid + 1, hi)
    best = times[lo]
    shares = [most(g, best) * y for g, (_, y) in enumerate(groups)]
    for g in reversed(range(len(groups))):  # give back what exceeds the samples; no group's time grows
        back = min(sum(shares) - samples, shares[g] - 1)
        shares[g] -= back
    return best, tuple(shares)


def _times(c: ReplicaConfig, first: int, last: int, mean_tokens: float, updates: int) -> list[float]:
    """:func:`replica_time` for each sample count from ``first`` (at least one) to ``last``, inlined: it is most of
    :func:`best_split`'s work."""
    h, longest, rebuild = c.tokens_per_s, c.longest_s, updates * c.recompute_s
    # max(x, longest) without the call: x unless longest is larger.
    return [
        (longest if longest > (x := k * mean_tokens / h) else x) + rebuild for k in range(first, last + 1)
    ]


class InFlight:
    """The runtime choices of fleets on one cost model (replica speeds at each cap memoised)."""

    def __init__(self, cm: CostModel, clocked: bool = True) -> None:
        self.cm = cm
        self.clocked = clocked  # its work goes on the search's clock
        self._throttled: dict[tuple[ReplicaConfig, int], ReplicaConfig] = {}
        self._ran: dict[tuple[ReplicaConfig, bool], ReplicaConfig] = {}

    def throttled(self, config: ReplicaConfig, cap: int) -> ReplicaConfig:
        """``config`` with at most ``cap`` sequences in flight."""
        if cap >= config.concurrency:
            return config
        key = (config, cap)
        found = self._throttled.get(key)
        if found is None:
            estimate = self.cm.rollout(replica_stages(config), max_sequences=cap)
            found = replace(
                config,
                tokens_per_s=estimate.tokens_per_s,
                concurrency=estimate.concurrency,
                recompute_s=estimate.recompute_s,
                longest_s=estimate.longest_s,
                drain_s=estimate.drain_s,
            )
            self._throttled[key] = found
        return found

    def as_run(self, groups: Groups, window: int) -> Groups:
        """:func:`as_run` on this cost model, each replica's config as run memoised (it depends on the window only
        through :func:`drains`): the brute force asks it of every fleet at every cap."""
        drained = drains(self.cm.workload.rl.max_head_offpolicyness, window)
        out = []
        for c, y in groups:
            ran = self._ran.get((c, drained))
            if ran is None:
                ran = self._ran[c, drained] = as_run(self.cm, ((c, 1),), window)[0][0]
            out.append((ran, y))
        return tuple(out)

    def capped(self, groups: Groups, fraction: float, sequences: int) -> Groups:
        """Every replica at ``fraction`` of its batch, all cut in proportion to hold at most ``sequences``."""
        return self.throttle(groups, self.caps(groups, fraction, sequences))

    @staticmethod
    def caps(groups: Groups, fraction: float, sequences: int) -> tuple[int, ...]:
        """The in-flight cap of each group's replicas in :meth:`capped`."""
        caps = [max(1, int(c.concurrency * fraction)) for c, _ in groups]
        total = sum(cap * y for cap, (_, y) in zip(caps, groups, strict=True))
        if total > sequences:
            caps = [max(1, cap * sequences // total) for cap in caps]
        return tuple(caps)

    def fractions(self) -> tuple[float, ...]:
        """The caps tried, as fractions of each replica's batch: none below admission's share where admission is
        fixed (``rl.max_admitted``: a measured run, whose servers take every sequence admission lets in)."""
        return (1.0,) if self.cm.workload.rl.max_admitted else CAP_FRACTIONS

    def throttle(self, groups: Groups, caps: tuple[int, ...]) -> Groups:
        """Each group's replicas at its cap."""
        return tuple((self.throttled(c, cap), y) for cap, (c, y) in zip(caps, groups, strict=True))

    def runtimes(self, groups: Groups, reward_s: float) -> list[Runtime]:
        """Per update window the staleness bound allows, the caps with the shortest rollout time per step (for a
        given window the step only grows with it): the caps of each fraction, cut to hold at most m batches'
        sequences for every m the window admits, so the choices at eta are among those at eta + 1; the window's
        samples split as :func:`best_split` splits them."""
        rl = self.cm.workload.rl
        eta, mean = rl.max_head_offpolicyness, self.cm.workload.output_lengths.mean
        # Caps cut to m batches, for m = 1 .. ahead(eta, 1), largest m and caps first (ties keep larger caps); each
        # distinct fleet numbered once (hashing fleets is most of this method's time).
        ids: dict[Groups, int] = {}
        by_caps: dict[tuple[int, ...], int] = {}  # caps already throttled: the same caps, the same fleet
        by_batches: list[list[int]] = []
        most = ahead(eta, 1)
        for batches in range(most, 0, -1):
            sequences = self.cm.staleness_sequences(batches)
            numbered = []
            for f in self.fractions():
                caps = self.caps(groups, f, sequences)
                if caps not in by_caps:
                    by_caps[caps] = ids.setdefault(self.throttle(groups, caps), len(ids))
                numbered.append(by_caps[caps])
            by_batches.append(list(dict.fromkeys(numbered)))
        fleets = list(ids)
        runs: dict[tuple[int, bool], Groups] = {}  # :func:`as_run` depends on the window only through drains
        out = []
        for window in windows(eta, rl.max_update_window):
            samples = rl.samples_per_step * window
            drained = drains(eta, window)
            # The window keeps up to ahead(eta, window) batches in flight. Caps are ranked by rollout seconds, in a
            # window that drains too (there the first batch's wait, a step's share of ``longest_s``, differs by
            # caps as well, but only where training is the longer phase); caps whose admission cannot replace a
            # batch during training apart per batches in flight (their wait depends on those and on training).
            best: dict[float | None, Runtime] = {}
            kept = by_batches[most - ahead(eta, window) :]
            admitted = list(dict.fromkeys(k for ks in kept for k in ks))
            if self.clocked:
                charge(len(admitted) * SCORE_WORK)
            for k in admitted:
                fleet = runs.get((k, drained))
                if fleet is None:
                    fleet = runs[k, drained] = as_run(self.cm, fleets[k], window)
                held = runtime_of(self.cm, fleet, window, math.inf)
                known = best.get(kind(held))
                if known and split_floor(fleet, samples, mean) / window + reward_s >= known.rollout_s:
                    continue
                rollout = window_rollout(fleet, best_split(fleet, samples, mean)[0], window, eta, reward_s)
                if known is None or rollout < known.rollout_s:
                    best[kind(held)] = replace(held, rollout_s=rollout)
            out += best.values()
        return out


def kind(runtime: Runtime) -> float | None:
    """Runtimes of a window that rank by rollout seconds alone share a kind: those whose admission replaces a
    batch during training (None), and those that cannot, per batches in flight (``tight_step_s``)."""
    return None if runtime.room >= 1 else round(runtime.batches, 6)


def rollout_floor(tokens_per_s: float, samples: int, mean_tokens: float, reward_s: float) -> float:
    """No runtime choice of a fleet generating at most ``tokens_per_s`` has a shorter rollout time per step."""
    return samples * mean_tokens / tokens_per_s + reward_s if tokens_per_s > 0 else math.inf


def choose(options: list[Runtime], train_s: float, sync_s: float) -> Runtime:
    """The choice with the shortest step; ties go to the shorter window (fresher weights), then larger caps."""
    return min(options, key=lambda o: round(o.step_s(train_s, sync_s), 9))
