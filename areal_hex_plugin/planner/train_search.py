"""Phase 1a: the training layout search over the training machines of a split.

The paper's rule: TP and DP groups stay inside one GPU type, types mix only across pipeline stages, and layers
are split across stages in proportion to stage compute (the cost model does the split). TP stays inside a machine.

Pruning:
- symmetry (exact): the stages of one pool are identical (dp, tp) and contiguous; the cost model splits the
  layers, so stages of one pool may hold different layer counts. Pools appear in every order up to MAX_REORDERED
  pools (the first stage holds the embedding, the last the LM head), in a fixed order beyond;
- hybrid sharding (FSDP shards within each machine and replicates across machines) only for one stage on all of a
  pool's training machines, where the runtime allows it;
- dominance: a stage of given (k stages, tp) takes the largest dp its pool's GPUs allow that divides a step's
  samples (upstream deals them out evenly over the DP ranks); exact while more data parallelism never slows a
  stage down;
- depth (heuristic; exhaustive mode tries every depth): every depth up to ALL_DEPTHS, then a ladder (6, 8, 12,
  16, ...) up to hex.solver.max_pp_stages (default: the model's layers), per pool only while memory rules out some
  TP degree at the depth before, reached from the shallow search's layout by the one-pool moves of the polish
  below (enumerated where nothing fits shallower), kept only where faster. Stages sharing one dp and tp over
  several pools are also deepened one pool at a time from the shallow layout (:func:`_deepen`): there a pool's
  stage count is the only way to train on more of its GPUs;
- memory (exact): layouts whose GPUs together cannot hold the sharded training state are skipped unscored, and
  those the cost model reports as not fitting are dropped;
- heuristic, with many layouts (exhaustive mode tries them all): per pool and stage count k, only the two TP
  degrees (with four or more pools: the one) that are best when the pool trains alone; then, one pool at a time,
  another (k, tp), or the pool leaving or joining, while that helps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache
from itertools import islice, permutations

from areal_hex_plugin.costmodel import CostModel, TrainEstimate, TrainStage
from areal_hex_plugin.costmodel.memory import TRAIN_BYTES_PER_PARAM, USABLE_HBM_FRACTION
from areal_hex_plugin.specs.cluster import Cluster, Pool

# Beyond this many layouts the per-pool TP cut is applied (outside exhaustive mode), keeping this many TP
# degrees per pool and stage count.
FULL_ENUMERATION_LIMIT = 150
# Layouts scored per search outside exhaustive mode (a few seconds of cost model): many pools with deep pipelines,
# or equal-stage layouts, would otherwise enumerate for minutes whatever hex.solver.time_limit_s says.
MAX_SCORED_LAYOUTS = 2_000
TP_PER_DEPTH = 2
# Up to this many pools, layouts are enumerated in every pool order.
MAX_REORDERED = 3
# Every pipeline depth up to this one is tried; deeper ones on a ladder (:func:`depths`).
ALL_DEPTHS = 4


@dataclass(frozen=True)
class TrainChoice:
    stages: tuple[TrainStage, ...]
    estimate: TrainEstimate

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s


@dataclass(frozen=True)
class _PoolOption:
    pool: str
    k: int  # pipeline stages on this pool
    tp: int
    dp: int
    hybrid: bool = False


def tp_degrees(gpus_per_machine: int) -> list[int]:
    """TP degrees that keep every TP group inside one machine and pack machines exactly.

    Powers of two dividing the machine size, plus the machine size itself: a divisibility chain.
    """
    degrees = [1]
    while gpus_per_machine % (degrees[-1] * 2) == 0:
        degrees.append(degrees[-1] * 2)
    if degrees[-1] != gpus_per_machine:
        degrees.append(gpus_per_machine)
    return degrees


def depths(max_pp: int) -> list[int]:
    """The pipeline depths the search tries up to ``max_pp``: every one up to ALL_DEPTHS, then a ladder growing
    by about 1.5x (6, 8, 12, 16, 24, 32, ...), and ``max_pp`` itself (exhaustive mode tries every depth)."""
    out, k = list(range(1, min(max_pp, ALL_DEPTHS) + 1)), ALL_DEPTHS
    while k < max_pp:
        out += [d for d in (k + k // 2, 2 * k) if d < max_pp]
        k *= 2
    return out + [max_pp] if max_pp > ALL_DEPTHS else out


def _largest_dp(most: int, samples: int) -> int:
    """The largest data-parallel degree up to ``most`` that divides a step's ``samples`` (upstream deals them out
    evenly over the DP ranks; 0 samples: no such rule), 0 if none."""
    return next((dp for dp in range(most, 0, -1) if not samples or samples % dp == 0), 0)


def _options(
    pool: Pool, gpus: int, max_pp: int, samples: int, hybrid: bool = False, exhaustive: bool = False
) -> list[_PoolOption]:
    options = []
    for k in range(1, max_pp + 1) if exhaustive else depths(max_pp):
        for tp in tp_degrees(pool.gpus_per_machine):
            dp = _largest_dp(gpus // (k * tp), samples)
            if dp >= 1:
                options.append(_PoolOption(pool.name, k, tp, dp))
            if hybrid and k == 1 and gpus >= 2 * pool.gpus_per_machine:
                options.append(_PoolOption(pool.name, 1, tp, dp, hybrid=True))
    return options


def _stages(combo: tuple[_PoolOption, ...]) -> tuple[TrainStage, ...]:
    return tuple(TrainStage(o.pool, o.dp, o.tp, o.hybrid) for o in combo for _ in range(o.k))


def _combinations(per_pool: list[list[_PoolOption]], max_pp: int) -> Iterator[tuple[_PoolOption, ...]]:
    """Every choice of at most one option per pool (at least one pool), with at most ``max_pp`` stages."""

    def extend(i: int, left: int) -> Iterator[tuple[_PoolOption, ...]]:
        if i == len(per_pool):
            yield ()
            return
        yield from extend(i + 1, left)
        for option in per_pool[i]:
            if option.k <= left:
                for rest in extend(i + 1, left - option.k):
                    yield (option, *rest)

    return (combo for combo in extend(0, max_pp) if combo)


def count_layouts(per_pool: list[list[_PoolOption]], max_pp: int) -> int:
    """How many layouts :func:`_combinations` yields, counted without listing them."""

    @cache
    def count(i: int, left: int) -> int:
        if i == len(per_pool):
            return 1
        return count(i + 1, left) + sum(count(i + 1, left - o.k) for o in per_pool[i] if o.k <= left)

    return count(0, max_pp) - 1


def _equal_combinations(
    pools: list[Pool], gpus: dict[str, int], max_pp: int, exhaustive: bool = False, deepest: int = 0
) -> Iterator[tuple[_PoolOption, ...]]:
    """Layouts whose stages all have one dp and one tp (Megatron's): per common (tp, dp), every choice of stage
    counts per pool (on the :func:`depths` ladder up to ``deepest``, all in exhaustive mode) with at most
    ``max_pp`` stages in all, each once, in every pool order up to MAX_REORDERED pools (the last stage also
    computes the LM head: on a slow type it sets the step). The dp tried are each pool's largest for some depth."""
    tried = range(1, max_pp + 1) if exhaustive else [k for k in depths(max_pp) if k <= (deepest or max_pp)]
    orders = list(permutations(pools)) if len(pools) <= MAX_REORDERED else [tuple(pools)]
    for tp in sorted({t for p in pools for t in tp_degrees(p.gpus_per_machine)}):
        dps = {gpus[p.name] // (k * tp) for p in pools for k in tried} - {0}
        for dp in sorted(dps):

            def extend(
                order: tuple[Pool, ...], i: int, left: int, dp: int = dp, tp: int = tp
            ) -> Iterator[tuple[_PoolOption, ...]]:
                if i == len(order):
                    yield ()
                    return
                pool = order[i]
                yield from extend(order, i + 1, left)
                if tp not in tp_degrees(pool.gpus_per_machine):
                    return
                for k in (k for k in tried if k <= min(left, gpus[pool.name] // (dp * tp))):
                    for rest in extend(order, i + 1, left - k):
                        yield (_PoolOption(pool.name, k, tp, dp), *rest)

            # A layout of a subset of the pools comes from every order that keeps that subset's order.
            seen: set[tuple[_PoolOption, ...]] = set()
            for order in orders:
                for combo in extend(order, 0, max_pp):
                    if combo and combo not in seen:
                        seen.add(combo)
                        yield combo


def search_train(
    cm: CostModel,
    cluster: Cluster,
    gpus: dict[str, int],
    max_pp: int,
    exhaustive: bool = False,
    equal_stages: bool = False,
    hybrid: bool = False,
) -> TrainChoice | None:
    """The fastest feasible training layout on ``gpus`` (pool name -> GPUs), or None if nothing fits.

    ``equal_stages``: only layouts whose stages share one dp and tp; ``hybrid``: FSDP hybrid sharding is allowed
    (runtime caps, see ``planner/caps.py``). Pipelines of more than ALL_DEPTHS stages are searched where memory
    needs them (:func:`_as_deep_as_needed`), by a second search whose layout is kept only if faster: a bound
    above ALL_DEPTHS never gives a slower layout than ALL_DEPTHS does. Exhaustive mode: one search, every depth;
    equal stages over several pools: the shallow layout deepened pool by pool (:func:`_deepen`).
    """
    # Faster GPUs first: the first pool order enumerated (the only one beyond MAX_REORDERED pools).
    pools = sorted((cluster.pool(name) for name in gpus), key=lambda p: (-p.gpu.tflops_bf16, p.name))
    samples = cm.workload.rl.samples_per_step if cm.workload.rl.even_dispatch else 0
    options = [
        _options(p, gpus[p.name], max_pp, samples, hybrid and len(gpus) == 1, exhaustive) for p in pools
    ]
    if exhaustive or max_pp <= ALL_DEPTHS:
        return _choice(_search(cm, pools, gpus, options, max_pp, exhaustive, equal_stages))
    shallow = [[o for o in opts if o.k <= ALL_DEPTHS] for opts in options]
    best = _search(cm, pools, gpus, shallow, ALL_DEPTHS, False, equal_stages)
    if best is not None and equal_stages and len(pools) > 1:
        best = _deepen(cm, best, gpus, max_pp)
    deep = [_as_deep_as_needed(cm, opts) for opts in options]
    if deep == shallow:
        return _choice(best)
    if best is None or equal_stages:
        # Nothing fits within ALL_DEPTHS stages, or stages share one dp and tp: the deep options enumerated.
        found = _search(cm, pools, gpus, deep, max_pp, False, equal_stages)
        if best is None or (found is not None and found[0] < best[0]):
            best = found
        return _choice(best)
    # From the shallow search's layout: one pool at a time to a deeper (k, tp) while that helps.
    polished = _polish(cm, best, deep, max_pp, deeper_than=ALL_DEPTHS)
    return _choice(_reorder_and_narrow(cm, polished) if polished is not best else best)


def _choice(best) -> TrainChoice | None:
    return TrainChoice(_stages(best[1]), best[2]) if best is not None else None


def _search(
    cm: CostModel,
    pools: list[Pool],
    gpus: dict[str, int],
    full_options: list[list[_PoolOption]],
    max_pp: int,
    exhaustive: bool,
    equal_stages: bool,
) -> TrainChoice | None:
    """The enumeration of :func:`search_train` over these options per pool, at most ``max_pp`` stages: the best
    (step seconds, options, estimate), or None."""
    pruned = (
        not exhaustive
        and not equal_stages
        and len(pools) > 1
        and count_layouts(full_options, max_pp) > FULL_ENUMERATION_LIMIT
    )
    per_pool = full_options
    if pruned:
        # Two TP degrees per depth while that stays near the enumeration limit, else one.
        per_pool = [_best_tp_per_depth(cm, opts, TP_PER_DEPTH) for opts in full_options]
        if count_layouts(per_pool, max_pp) > 2 * FULL_ENUMERATION_LIMIT:
            per_pool = [_best_tp_per_depth(cm, opts, 1) for opts in full_options]
    usable = {p.name: USABLE_HBM_FRACTION * p.gpu.hbm_bytes for p in pools}
    state = cm.workload.model.params * TRAIN_BYTES_PER_PARAM
    scored: list[tuple[float, tuple[_PoolOption, ...], TrainEstimate]] = []
    if equal_stages:
        deepest = max((o.k for opts in full_options for o in opts), default=1)
        combos = _equal_combinations(pools, gpus, max_pp, exhaustive, deepest)
    elif len(pools) <= MAX_REORDERED:
        # Few pools: every pipeline order (which stage holds the embedding and which the output layer matters).
        combos = (c for order in permutations(per_pool) for c in _combinations(list(order), max_pp))
    else:
        combos = _combinations(per_pool, max_pp)
    if not exhaustive:  # bounded whatever the recipe: the first MAX_SCORED_LAYOUTS in enumeration order
        combos = islice(combos, MAX_SCORED_LAYOUTS)
    for combo in combos:
        if sum(o.k * o.dp * o.tp * usable[o.pool] for o in combo) < state:
            continue
        estimate = cm.train(_stages(combo))
        if estimate.feasible:
            scored.append((estimate.step_time_s, combo, estimate))
    if not scored:
        return None
    scored.sort(key=lambda x: x[0])
    best = scored[0]
    if pruned:
        best = _polish(cm, best, full_options, max_pp)
    return best if equal_stages else _reorder_and_narrow(cm, best)


def _reorder_and_narrow(cm: CostModel, best):
    """After the enumeration (fixed pool order, largest dp): the best layout's pools in every other order (up to
    three pools) and each pool's dp a little narrower (layers are whole, so a narrower stage can balance the
    pipeline better), while that helps."""
    improved = True
    while improved:
        improved = False
        combo = best[1]
        trials = [tuple(order) for order in permutations(combo)] if len(combo) <= MAX_REORDERED else []
        for i, o in enumerate(combo):
            for dp in sorted({o.dp - 1, o.dp - 2, o.dp - 3, (3 * o.dp + 3) // 4, (o.dp + 1) // 2} - {o.dp}):
                if dp >= 1:
                    trials.append((*combo[:i], replace(o, dp=dp), *combo[i + 1 :]))
        for trial in trials:
            if trial == combo:
                continue
            estimate = cm.train(_stages(trial))
            if estimate.feasible and estimate.step_time_s < best[0]:
                best, improved = (estimate.step_time_s, trial, estimate), True
    return best


def _deepen(cm: CostModel, best, gpus: dict[str, int], max_pp: int):
    """Stages sharing one dp and tp over several pools, after the shallow search: one pool at a time to more
    stages of the layout's dp and tp (deeper depths on the :func:`depths` ladder) while that helps. There a
    pool's stage count is the only way to train on more of its GPUs, whether or not memory needs depth."""
    improved = True
    while improved:
        improved = False
        combo = best[1]
        stages = sum(o.k for o in combo)
        for i, o in enumerate(combo):
            for k in depths(max_pp):
                if k <= o.k or stages - o.k + k > max_pp or k * o.dp * o.tp > gpus[o.pool]:
                    continue
                trial = (*combo[:i], replace(o, k=k), *combo[i + 1 :])
                estimate = cm.train(_stages(trial))
                if estimate.feasible and estimate.step_time_s < best[0]:
                    best, improved = (estimate.step_time_s, trial, estimate), True
    return best


def _polish(cm: CostModel, best, full_options: list[list[_PoolOption]], max_pp: int, deeper_than: int = 0):
    """After the pruned enumeration: change one pool at a time (another (k, tp), drop it, or add it) while that
    helps; with ``deeper_than``, only to options of more stages than that (the shallower ones were searched)."""
    order = [opts[0].pool for opts in full_options if opts]
    improved = True
    while improved:
        improved = False
        chosen = {o.pool: o for o in best[1]}
        for options in full_options:
            if not options:
                continue
            pool = options[0].pool
            for option in (None, *options):
                if option == chosen.get(pool) or (
                    deeper_than and (option is None or option.k <= deeper_than)
                ):
                    continue
                changed = {**chosen, pool: option}
                trial = tuple(changed[p] for p in order if changed.get(p) is not None)
                if not trial or sum(o.k for o in trial) > max_pp:
                    continue
                estimate = cm.train(_stages(trial))
                if estimate.feasible and estimate.step_time_s < best[0]:
                    best, improved = (estimate.step_time_s, trial, estimate), True
    return best


def _as_deep_as_needed(cm: CostModel, options: list[_PoolOption]) -> list[_PoolOption]:
    """A pool's options of at most ALL_DEPTHS stages, then those of each deeper depth on the ladder while memory
    still binds at the depth before: while its lowest TP degree does not fit alone (a deeper pipeline holds fewer
    layers per GPU, so a lower TP degree may fit). Where every TP degree fits, a deeper pipeline only
    adds bubble and hand-offs (heuristic: :func:`search_train` keeps the shallow search's layout unless faster)."""
    kept = [o for o in options if o.k <= ALL_DEPTHS]
    before = max((o.k for o in kept), default=0)
    for k in sorted({o.k for o in options if o.k > ALL_DEPTHS}):
        # The lowest TP degree needs the most memory per GPU (activations split over tp, state as much or more).
        lowest = min((o for o in options if o.k == before and not o.hybrid), key=lambda o: o.tp, default=None)
        if lowest is None or cm.train(_stages((lowest,))).feasible:
            break
        kept += [o for o in options if o.k == k]
        before = k
    return kept


def _best_tp_per_depth(cm: CostModel, options: list[_PoolOption], keep: int) -> list[_PoolOption]:
    """For each stage count k, the ``keep`` TP degrees that are best when the pool trains alone (all of them if
    none fits alone: in a pipeline the pool holds fewer layers)."""
    kept: list[_PoolOption] = []
    for k in sorted({o.k for o in options}):
        same_k = [o for o in options if o.k == k]
        scored = [(cm.train(_stages((o,))), o) for o in same_k]
        feasible = sorted((e.step_time_s, o.tp) for e, o in scored if e.feasible)
        best_tps = {tp for _, tp in feasible[:keep]}
        kept += [o for o in same_k if o.tp in best_tps] if feasible else same_k
    return kept
