"""The two-phase loop (Algorithm 1) over splits within machine limits and a budget.

Two-phase:
1. bisection on training's compute share gamma (start at 1: all compute to training); each gamma gives an
   Eq. (3) split (phase 2, partition_model), which phase 1 scores (C_T, C_I); if C_T < C_I training gets less
   compute, else more; it stops once max(C_T, C_I) has been stable for K iterations;
2. the EM-style alternation (balance_model): phase 1 measures each pool's training and rollout rates, CP-SAT
   repartitions on them, until the split repeats; run from the bisection's best split, on every subset of pools,
   and with training confined to each single pool (weight sync across slow links and pipelines over slow
   cross-type links make the landscape rugged); Eq. (3) splits on a coarse gamma grid join the starts;
3. a local search (one machine moved, else two moves in one or two pools) from the best distinct starts, and from
   the best of a ladder chain (single moves; :func:`_ladder`: the alternation at fixed budget levels below it).
Every split is scored with its own update window delta(eta) and in-flight caps (``inflight``), the search's at
STEER_ETA whatever the recipe's eta from 1 on (:func:`steering_eta`); at the end the splits it scored best and
their neighbours (:func:`candidates`) are scored at the recipe's eta, and the cheapest within THROUGHPUT_TIE of the
fastest of them is returned. Exhaustive mode (``planner/brute.py``) shares none of this.

Monotonicity. Per split: from eta = 1 on a split never scores worse with a larger eta (``inflight``: the choices at
eta are among those at eta + 1; from 0 to 1 a step no longer drains nor takes turns with training, which the
tests check split by split), and a split within a budget is within every larger one; so the best of any fixed set of
splits is monotone in both. In eta across separate solves, exact by construction from eta = 1 on: the search is
steered by scores at STEER_ETA and its clock counts only the steering work (the recipe's eta is scored off the
clock), so the splits it visits, where the work limit stops it and the splits it rescores are the same for every
eta >= 1; the fastest of them at the recipe's eta is monotone in eta, and the plan (the cheapest within
THROUGHPUT_TIE of it) within THROUGHPUT_TIE of that. An eta = 0 search is steered at 0, a different trajectory: that eta = 1 does no
worse is measured (eta = 0 plans reach about half the tokens/s), not built in.
In the budget, in part. Built in: (a) the ladder chain (:func:`_ladder`) steps through fixed levels (k / LADDER of
the price of the machines in play), never through the budget, so every split it scores below a level is scored,
the same, by every search whose budget is above that level (unless the work limit stops the search first), and
that search's steering best (``SearchResult.steered``) is at least as fast at the steering eta as each of them;
(b) the rescored splits are those of the RESCORED best steering scores (:func:`candidates`), counted by score and
per score the cheapest and those training as the cheapest does, so splits that only add machines a plan leaves
without effect, which a larger budget admits more of, cannot crowd a distinct plan out.
Not built in: the rest of the search (bisection, repartitions, gamma grid, local search) visits splits that
depend on the budget and a larger budget can miss the best of them; where the recipe's eta is not the steering one,
the plan is the fastest of the RESCORED best steering scores, which a larger budget's extra splits can displace;
a search without a budget runs no chain (it partitions every machine: a different trajectory, as at eta = 0).
``benchmarks/planner.py`` measures what is left (``monotonicity``); the brute force is exactly monotone in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations, groupby, islice

from areal_hex_plugin.planner.balance_model import BalanceRequest, solve_balance
from areal_hex_plugin.planner.cpsat import charge, clock, deterministic_limit
from areal_hex_plugin.planner.evaluate import Evaluation, Evaluator
from areal_hex_plugin.planner.partition_model import PartitionRequest, solve_partition
from areal_hex_plugin.planner.split import Split, shared_choices, shared_splits

# Throughputs closer than this (relative) count as a tie, settled by cost.
THROUGHPUT_TIE = 1e-3
# The staleness bound the search is steered at, whatever the recipe's from eta = 1 on (see Monotonicity above).
# Random small clusters, two-phase (16 rescored, no neighbours) within 1% of the brute force at eta 1, 2, 4, 8
# (of 48; worst ratio): steered at 4, 38 (0.945); at 8, 36 (0.926: its splits suit eta 1 and 2 worst); at 2, 38
# (0.945, but 0.955 at eta 8); at 1, 37 (0.859 at eta 8).
STEER_ETA = 4
# Splits the steering scored best that are rescored at the recipe's eta at the end of a search, and how many of
# the best also have their neighbours rescored (random small clusters, two-phase / brute force at eta 1, 2, 4, 8:
# 8 and 0 missed the best visited split; 16 and 2, rollout moves only, matched the search steered at the recipe's
# eta, 39 of 48 within 1%). Since a step waits for what admission's room leaves unreplaced during training
# (``inflight.kind``), the recipe's eta ranks training moves apart from the steering's too: 5 and every move
# (test_budget_monotone's 14B case, 40,259 tokens/s at $210/h against 41,236 at $205/h before; the 7B plan at
# 1,024 GPUs 2.84 -> 3.00 s, at 10,240 GPUs 28.4 -> 30.0 s, side by side).
RESCORED = 16
NEIGHBOURED = 5
# Starts of the local search (the best distinct splits reached so far): more where few pools keep it cheap.
REFINED_STARTS = 3
REFINED_STARTS_FEW_POOLS = 5  # with at most FEW_POOLS pools in play
FEW_POOLS = 3
# Training compute shares whose Eq. (3) splits also start the local search.
GAMMA_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
MAX_POOLS_FOR_ALL_SUBSETS = 6
# The local search's first stride is at most this share (1/STRIDE_SHARE) of the largest pool.
STRIDE_SHARE = 8
# Budget levels of the ladder chain (fractions k / LADDER of the price of the machines in play).
LADDER = 8
# A safety cap on bisection iterations (gamma's interval is below 1e-9 long before it).
MAX_ITERATIONS = 200


@dataclass(frozen=True)
class SearchResult:
    best: Evaluation | None  # at the recipe's eta
    status: str  # converged | optimal | timeout | infeasible
    iterations: int
    steered: Evaluation | None = None  # the steering evaluator's best (the same for every recipe eta)


def better(a: Evaluation | None, b: Evaluation, tokens_per_step: float) -> Evaluation:
    """Higher throughput wins; ties go to the cheaper split, then to C_T <= C_I, then to the smaller split."""
    if a is None:
        return b

    def key(e: Evaluation):
        return (round(e.tokens_per_s(tokens_per_step), 6), -round(e.cost_per_hour, 6), e.c_t <= e.c_i)

    if key(b) != key(a):
        return b if key(b) > key(a) else a
    return min(a, b, key=lambda e: e.split)


def steering_eta(eta: int) -> int:
    """The staleness bound a search for a recipe at ``eta`` is steered at: STEER_ETA from 1 on; 0 at 0, where the
    cost model changes regime (every step drains its long tail, then trains: splits steered at STEER_ETA missed
    the best ones by 12-23% of the brute force's tokens/s when each batch of a replica drained)."""
    return STEER_ETA if eta else 0


def candidates(steer: Evaluator, limits: tuple[int, ...], budget: float | None) -> list[Split]:
    """The splits of the RESCORED best steering scores (per score the cheapest, and those with the cheapest's
    training machines) among those within ``limits`` and ``budget`` as scored (a split's layouts occupy only its
    machines), and the splits one move from the NEIGHBOURED best (the steering's local search skips those it
    scores lower, which another eta may not): the same for every recipe eta."""
    tokens = steer.tokens_per_step
    inside = [
        (split, e)
        for split, e in steer.scored_splits().items()
        if e.feasible
        and all(split.machines(i) <= m for i, m in enumerate(limits))
        and (budget is None or split.cost_per_hour(steer.cluster) <= budget + 1e-9)
    ]

    # Per steering score, the cheapest splits: splits that add machines a plan leaves without effect score the
    # same, and a larger budget admits more of them, which would crowd distinct plans out of the RESCORED (all of
    # a score's splits: test_budget_monotone's 7B case 134,028 -> 129,769 tokens/s at the larger budget). All of
    # the cheapest, not one: at the steering eta a replica whose longest sample outlasts the window's rollout
    # generates nothing, so splits that give it machines tie (at the price of the machines their plans occupy)
    # with splits that leave those idle or to training, and the recipe's larger eta may put them to work. And the
    # splits that train on the cheapest's machines: where training binds at the steering eta, splits adding
    # rollout machines tie with it, and at a smaller eta (shorter windows, or ones that drain) the rollout binds
    # (3x8 H100 + 2x4 L40S, 7B, eta 1: the brute force's 1 H100 machine training and 2 generating tied at eta 4
    # with 1 + 1, which rescored 19% slower).
    def score(x: tuple[Split, Evaluation]) -> float:
        return round(x[1].tokens_per_s(tokens), 6)

    def cost(x: tuple[Split, Evaluation]) -> float:
        return round(x[1].cost_per_hour, 6)

    ranked = sorted(inside, key=lambda x: (-score(x), cost(x), x[0]))
    groups = [list(group) for _, group in islice(groupby(ranked, key=score), RESCORED)]
    top = [
        split
        for group in groups
        for split, e in group
        if cost((split, e)) == cost(group[0]) or split.train == group[0][0].train
    ]
    near = [
        n
        for split in (group[0][0] for group in groups[:NEIGHBOURED])
        for n in split.neighbours(limits)
        if n.trains()
        and n.generates()
        and (budget is None or n.cost_per_hour(steer.cluster) <= budget + 1e-9)
    ]
    return list(dict.fromkeys(top + near))


def rescore(
    steer: Evaluator, true: Evaluator, limits: tuple[int, ...], budget: float | None
) -> Evaluation | None:
    """The :func:`candidates` scored at the recipe's eta (``true``): of those within THROUGHPUT_TIE of the
    fastest, the cheapest, so a plan never rents machines for a gain the cost model cannot resolve. The fastest
    is exactly monotone in eta (a fixed set of splits, each scoring no worse with a larger eta); the plan is
    within THROUGHPUT_TIE of it."""
    tokens = true.tokens_per_step
    scored = [e for e in map(true.evaluate, candidates(steer, limits, budget)) if e.feasible]
    if not scored:
        return None
    floor = (1 - THROUGHPUT_TIE) * max(e.tokens_per_s(tokens) for e in scored)
    near = [e for e in scored if e.tokens_per_s(tokens) >= floor]
    return min(near, key=lambda e: (round(e.cost_per_hour, 6), -e.tokens_per_s(tokens), e.split))


def two_phase(
    steer: Evaluator, true: Evaluator, limits: tuple[int, ...], budget: float | None, deadline: float
) -> SearchResult:
    """The search, steered by ``steer`` (at STEER_ETA: every split it visits and the work it counts are the same
    for every recipe eta), its best splits rescored by ``true`` (at the recipe's eta, :func:`rescore`)."""
    ev = steer
    result = _bisect(ev, limits, budget, deadline)
    start, iterations = _alternate(ev, result.best, limits, budget, deadline)
    starts = [start]
    # Diversification: the same alternation restricted to each subset of pools (weight sync and slow
    # cross-type links make the landscape rugged; a plan on fewer types can be several moves away).
    for subset in pool_subsets(limits):
        if clock() > deadline:
            break
        sub_limits = tuple(m if i in subset else 0 for i, m in enumerate(limits))
        start, n = _alternate(ev, None, sub_limits, budget, deadline)
        starts.append(start)
        iterations += n
    # Eq. (3) splits on a coarse gamma grid: the bisection visits few shares, and pipelines that need
    # several types to fit in memory are invisible to single-pool rate tables.
    cache: dict[tuple[float, float], Split | None] = {}
    eps = _machine_share(ev, limits) / 2
    for gamma in GAMMA_GRID:
        if clock() > deadline:
            break
        split = _partition(ev, limits, budget, gamma, eps, cache, deadline)
        if split is not None and ev.evaluate(split).feasible:
            starts.append(ev.evaluate(split))
    # The rate tables add training rates across pools, which a pipeline over slow cross-type links does not
    # reach: also alternate with training confined to each single pool.
    for pool in (i for i, m in enumerate(limits) if m):
        if clock() > deadline:
            break
        start, n = _alternate(ev, None, limits, budget, deadline, frozenset((pool,)))
        starts.append(start)
        iterations += n
    found = sorted(
        {e.split: e for e in starts if e is not None}.values(),
        key=lambda e: -e.tokens_per_s(ev.tokens_per_step),
    )
    best = None
    few = sum(1 for m in limits if m) <= FEW_POOLS
    for start in found[: REFINED_STARTS_FEW_POOLS if few else REFINED_STARTS]:
        best = better(best, _refine(ev, start, limits, budget, deadline), ev.tokens_per_step)
    # The ladder chain's best, refined within the budget: no budget loses what the chain finds below it.
    chain, n = _ladder(ev, limits, budget, deadline)
    if chain is not None:
        best = better(
            best, _refine(ev, chain, limits, budget, deadline, pair_moves=False), ev.tokens_per_step
        )
    iterations += n
    best = _shared(ev, best, limits, budget, deadline)
    timed_out = result.status == "timeout" or clock() > deadline
    iterations += result.iterations
    if best is None:
        return SearchResult(None, "timeout" if timed_out else "infeasible", iterations)
    status = "timeout" if timed_out else "converged"
    return SearchResult(rescore(steer, true, limits, budget), status, iterations, best)


def _shared(
    ev: Evaluator, best: Evaluation | None, limits: tuple[int, ...], budget: float | None, deadline: float
) -> Evaluation | None:
    """On a small inventory (``split.shared_choices``), every split that shares a machine between training and
    rollout within the budget: a fixed set for the inventory, so the same at every eta and a subset of every
    larger budget's."""
    if not ev.caps.split_machines:
        return best
    for split in shared_splits(limits, shared_choices(ev.cluster, limits)):
        if clock() > deadline:
            break
        if budget is None or split.cost_per_hour(ev.cluster) <= budget + 1e-9:
            e = ev.evaluate(split)
            if e.feasible:
                best = better(best, e, ev.tokens_per_step)
    return best


def budget_ladder(ev: Evaluator, limits: tuple[int, ...], budget: float | None) -> list[float]:
    """The ladder's levels below ``budget`` (none without one): k / LADDER of the price of every machine within
    ``limits``, for k = 1 .. LADDER - 1. They depend on the inventory alone: a larger budget has them all."""
    if budget is None:
        return []
    full = sum(m * p.price_per_machine_hour for m, p in zip(limits, ev.cluster.pools, strict=True))
    return [full * k / LADDER for k in range(1, LADDER) if full * k / LADDER < budget]


def _ladder(
    ev: Evaluator, limits: tuple[int, ...], budget: float | None, deadline: float
) -> tuple[Evaluation | None, int]:
    """The ladder chain: at each level below the budget, lowest first, the alternation from the pools' rate
    curves within that level; a split it reaches that beats the chain's best so far is refined (single moves)
    within the level and becomes the chain's best (the level with the best start is not always the one that refines
    best: 9 L40S + 13 H100 + 2 H20 + 8 H200, 14B, at $969.09/h fell 1.2% short of the plan at $847.95/h with only
    the chain's best start refined, 0.2% so). No step depends on the budget, only on the level, so every budget
    above a level scores the same splits up to there (unless the work limit stops the search first). Returns the
    chain's best and the alternations' iterations."""
    chain, iterations = None, 0
    for level in budget_ladder(ev, limits, budget):
        if clock() > deadline:
            break
        start, n = _alternate(ev, None, limits, level, deadline)
        iterations += n
        if start is not None and better(chain, start, ev.tokens_per_step) is start:
            chain = _refine(ev, start, limits, level, deadline, pair_moves=False)
    return chain, iterations


def pool_subsets(limits: tuple[int, ...]) -> list[frozenset[int]]:
    """Proper subsets of the pools in play: all of them up to 6 pools, else those of one or two pools."""
    pools = [i for i, m in enumerate(limits) if m]
    sizes = range(1, len(pools)) if len(pools) <= MAX_POOLS_FOR_ALL_SUBSETS else range(1, 3)
    return [frozenset(c) for k in sizes for c in combinations(pools, k)]


def _bisect(ev: Evaluator, limits: tuple[int, ...], budget: float | None, deadline: float) -> SearchResult:
    q, r, gamma = 0.0, 1.0, 1.0
    history: list[float] = []
    best: Evaluation | None = None
    cache: dict[tuple[float, float], Split | None] = {}
    eps = _machine_share(ev, limits) / 2
    iterations = 0
    stable = ev.solver.stable_iterations
    while iterations < MAX_ITERATIONS:
        if iterations and clock() > deadline:
            return SearchResult(best, "timeout", iterations)
        iterations += 1
        split = _partition(ev, limits, budget, gamma, eps, cache, deadline)
        if split is None:
            break
        e = ev.evaluate(split)
        best = better(best, e, ev.tokens_per_step) if e.feasible else best
        if e.c_t < e.c_i:
            r = gamma
        else:
            q = gamma
        gamma = (q + r) / 2
        history.append(round(max(e.c_t, e.c_i), 9))
        if len(history) >= stable and len(set(history[-stable:])) == 1:
            break
    return SearchResult(best, "converged", iterations)


def _machine_share(ev: Evaluator, limits: tuple[int, ...]) -> float:
    """The largest share of the compute in play that one machine holds: the natural width of a gamma band."""
    compute = [p.gpu.tflops_bf16 * p.gpus_per_machine for p in ev.cluster.pools]
    total = sum(c * m for c, m in zip(compute, limits, strict=True))
    return max(c for c, m in zip(compute, limits, strict=True) if m) / total


def _partition(ev, limits, budget, gamma, eps, cache, deadline) -> Split | None:
    """The Eq. (3) split for the narrowest feasible band around gamma (widened by doubling)."""
    width = eps
    while True:
        band = (round(max(0.0, gamma - width), 3), round(min(1.0, gamma + width), 3))
        if band not in cache:
            request = PartitionRequest(limits, band[0], band[1], budget)
            limit = max(0.05, min(ev.solver.time_limit_s, deadline - clock()))
            cache[band] = solve_partition(ev.cluster, request, limit, ev.solver.num_workers, ev.solver.seed)
        if cache[band] is not None or band == (0.0, 1.0):
            return cache[band]
        width *= 2


def _alternate(
    ev: Evaluator,
    start: Evaluation | None,
    limits: tuple[int, ...],
    budget: float | None,
    deadline: float,
    train_pools: frozenset[int] | None = None,
) -> tuple[Evaluation | None, int]:
    """EM-style alternation: measure rate tables at the split (phase 1), repartition on them (CP-SAT).

    ``train_pools``, when given, are the only pools whose machines may train. Returns the best split seen and
    the number of iterations."""
    best = start
    current = start.split if start is not None else None
    seen: set[Split] = set()
    iterations = 0
    while iterations < ev.solver.stable_iterations:
        if best is not None and clock() > deadline:
            break
        iterations += 1
        train_rate, rollout_rate = _rates(ev, current, limits, train_pools)
        request = BalanceRequest(limits, budget, train_rate, rollout_rate)
        limit = max(0.05, min(ev.solver.time_limit_s, deadline - clock()))
        split = _balance(ev, request, limit)
        if split is None or split in seen:
            break
        seen.add(split)
        e = ev.evaluate(split)
        if e.feasible:
            best = better(best, e, ev.tokens_per_step)
        current = split
    return best, iterations


def _balance(ev: Evaluator, request: BalanceRequest, limit: float) -> Split | None:
    """:func:`solve_balance`, memoised per solve: an alternation often repeats a request (its second tables are
    its first where the split's counts lie on the rate curves' grid), and one worker solves the same model the
    same deterministic way, so a repeat gets the first split and charges the first's work again (more workers
    race: a repeat gets the first's split)."""
    key = (request, deterministic_limit(limit))
    if key in ev.balances:
        split, work = ev.balances[key]
        charge(work)
        return split
    split, work = solve_balance(ev.cluster, request, limit, ev.solver.num_workers, ev.solver.seed)
    ev.balances[key] = (split, work)
    return split


def _rates(ev: Evaluator, split: Split | None, limits: tuple[int, ...], train_pools: frozenset[int] | None):
    """Per pool, tables of training steps/s (pool alone) and rollout steps/s by machine count: the pool's rate
    curves (:func:`_curve`, measured once per solve) plus the split's own counts, as never-decreasing step
    functions."""
    train_tables, rollout_tables = [], []
    for i, limit in enumerate(limits):
        if train_pools is None or i in train_pools:
            train_tables.append(_table(ev, i, "train", limit, split.train[i] if split else 0))
        else:
            train_tables.append((0.0,) * (limit + 1))
        rollout_tables.append(_table(ev, i, "rollout", limit, split.rollout[i] if split else 0))
    return tuple(train_tables), tuple(rollout_tables)


def _rate(ev: Evaluator, i: int, kind: str, n: int) -> float:
    """Phase 1 on n machines of pool i alone: training steps/s, or the steps' worth of rollouts per second."""
    if kind == "train":
        choice = ev.train(tuple(n if j == i else 0 for j in range(len(ev.cluster.pools))))
        return 1 / choice.step_time_s if choice else 0.0
    generated = ev.workload.rl.samples_per_step * ev.workload.output_lengths.mean
    return ev.pool_fleet(ev.cluster.pools[i].name, n).tokens_per_s / generated


def _curve(ev: Evaluator, i: int, kind: str, limit: int) -> dict[int, float]:
    """Pool i's rate on a geometric grid of machine counts up to ``limit`` (1, 2, 3, 4, 6, 8, 12, ...), measured
    once per solve (memoised on the evaluator)."""
    key = (i, kind, limit)
    if key not in ev.curves:
        grid, n = {limit}, 1
        while n < limit:
            grid.update((n, n + n // 2))
            n *= 2
        ev.curves[key] = {m: _rate(ev, i, kind, m) for m in sorted(grid) if 0 < m <= limit}
    return ev.curves[key]


def _table(ev: Evaluator, i: int, kind: str, limit: int, current: int) -> tuple[float, ...]:
    measured = _curve(ev, i, kind, limit)
    if 0 < current <= limit and current not in measured:
        measured = {**measured, current: _rate(ev, i, kind, current)}
    table, best = [0.0], 0.0
    for m in range(1, limit + 1):
        best = max(best, measured.get(m, 0.0))
        table.append(best)
    return tuple(table)


def _refine(
    ev: Evaluator,
    start: Evaluation,
    limits: tuple[int, ...],
    budget: float | None,
    deadline: float,
    pair_moves: bool = True,
) -> Evaluation:
    """Local search from the best split: the best single-pool move while one helps, else (``pair_moves``) the best
    two-pool move. In pools of many machines single moves first shift ``stride`` machines, halving while none
    helps (a pattern search: a plan a hundred machines away is a few moves away)."""
    best = start
    stride = _first_stride(limits)
    while clock() < deadline:
        step = _best_move(ev, best, best.split.neighbours(limits, stride), budget, deadline)
        if step is None and stride > 1:
            stride //= 2
            continue
        if step is None and pair_moves:
            # Whole-pool moves in pairs only where few pools keep the pair neighbourhood small.
            few = sum(1 for m in limits if m) <= FEW_POOLS
            pairs = best.split.pair_neighbours(limits, whole=few)
            step = _best_move(ev, best, pairs, budget, deadline)
        if step is None:
            break
        best = step
    return best


def _first_stride(limits: tuple[int, ...]) -> int:
    """The largest power of two at most 1/STRIDE_SHARE of the largest pool (1 for pools under 2 * STRIDE_SHARE)."""
    stride = 1
    while stride * 2 * STRIDE_SHARE <= max(limits):
        stride *= 2
    return stride


def _best_move(ev: Evaluator, current: Evaluation, splits, budget, deadline) -> Evaluation | None:
    best = current
    for split in splits:
        if clock() > deadline:
            break
        if not (split.trains() and split.generates()):
            continue
        if budget is not None and split.cost_per_hour(ev.cluster) > budget + 1e-9:
            continue
        # The step is at least the rollout time: skip the training search where that alone cannot win (a shared
        # machine's rollout GPUs are not in the floor: those splits are scored).
        rate = best.tokens_per_s(ev.tokens_per_step)
        if not split.shared and ev.tokens_per_step / ev.rollout_floor(split.rollout) < rate:
            continue
        e = ev.evaluate(split)
        if e.feasible:
            best = better(best, e, ev.tokens_per_step)
    return None if best is current else best
