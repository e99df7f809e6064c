"""The recipe's own upstream allocation (``actor.backend``, ``rollout.backend``) scored as written, with no search.

The strings are upstream AReaL 1.0.4's (``areal/api/alloc_mode.py``): ``<backend>:<dims>``, dims ``d``, ``p``, ``t``
with their sizes in any order (1 where left out); ``fsdp`` takes no ``p``. Actor: ``fsdp`` or ``megatron``;
rollout: ``sglang``, ``d`` servers of ``t x p`` GPUs each.

Placement as upstream gives it: ``PPOTrainer`` creates the actor's workers before the rollout's, and the scheduler
hands out GPUs in order from one counter shared by the roles (``LocalScheduler._allocate_gpus``). Upstream has no
GPU types, so over several pools the GPUs are taken in the order of ``hex.cluster.pools``, machine by machine: the
actor's ranks stage-major (Megatron's ``tp-cp-ep-dp-pp`` order), each stage on one pool; then each rollout server on
``t x p`` GPUs of one machine, the actor's last machine first (not under ``hex_slurm``, whose roles get whole
machines), the rest of a machine that cannot hold another server left idle.

The step is scored by the planner's own evaluator (:meth:`Evaluator.score`), so it is priced by the same runtime as
every plan, at upstream's settings as the config writes them rather than the ones a plan chooses: weights to the
servers after every step, and admission capped at ``rollout.max_concurrent_rollouts`` (upstream takes
``consumer_batch_size`` where it is unset; a workload whose admission is fixed, a measured run's, keeps its own),
the servers taking every sequence it lets in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from areal_hex_plugin.costmodel import CostModel, TrainStage
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.caps import TRAIN_BACKENDS
from areal_hex_plugin.planner.evaluate import Evaluation, Evaluator, Fleet
from areal_hex_plugin.planner.split import Split
from areal_hex_plugin.planner.train_search import TrainChoice, tp_degrees
from areal_hex_plugin.specs.cluster import Cluster

ROLLOUT_BACKENDS = ("sglang",)
_ALLOCATION = re.compile(r"(?P<kind>[a-z]+)(\[[A-Za-z_]\w*\])?:(?P<dims>([a-z][1-9][0-9]*)+)")
_DIM = re.compile(r"([a-z])([1-9][0-9]*)")
_EXAMPLES = {"actor.backend": "fsdp:d8, megatron:d4p2t1", "rollout.backend": "sglang:d4p1t2"}


@dataclass(frozen=True)
class Allocation:
    """One upstream backend string: ``dp`` copies of a ``pp``-stage, ``tp``-wide model on ``kind``."""

    text: str
    kind: str
    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.tp


def parse_allocation(text: str, field: str, kinds: tuple[str, ...]) -> Allocation:
    """``text`` (``field``'s value) as one shape on one of ``kinds``; HexError naming the field otherwise."""
    fix = f"write one shape as upstream does, e.g. {_EXAMPLES[field]}"
    written = "".join(str(text).split())
    match = _ALLOCATION.fullmatch(written)
    if match is None:
        raise HexError(field, f"{text!r} is not an upstream allocation such as {_EXAMPLES[field]}", fix)
    kind = match["kind"]
    if kind not in kinds:
        raise HexError(field, f"backend {kind!r} is not one Hex scores", f"use {' or '.join(kinds)}: {fix}")
    dims: dict[str, int] = {}
    for letter, size in _DIM.findall(match["dims"]):
        if letter in dims:
            raise HexError(field, f"{text!r} gives {letter} twice", fix)
        dims[letter] = int(size)
    other = sorted(set(dims) - {"d", "p", "t", "c", "e"})
    if other:
        raise HexError(field, f"{text!r} has dimension {other[0]!r}; upstream's are d, p, t, c and e", fix)
    if any(dims.get(d, 1) > 1 for d in ("c", "e")):
        raise HexError(
            field,
            f"{text!r} uses context or expert parallelism, which the cost model does not price",
            "score it with c1 and e1 (or without them)",
        )
    if kind == "fsdp" and dims.get("p", 1) > 1:
        raise HexError(
            field, f"{text!r}: upstream's FSDP has no pipeline parallelism", "use megatron:dXpYtZ for p > 1"
        )
    return Allocation(str(text), kind, dims.get("d", 1), dims.get("p", 1), dims.get("t", 1))


def recipe_allocations(recipe) -> tuple[Allocation, Allocation]:
    """The recipe's ``actor.backend`` and ``rollout.backend``, parsed."""
    config = recipe.config
    actor = (config.get("actor") or {}).get("backend", "")
    rollout = (config.get("rollout") or {}).get("backend", "")
    return (
        parse_allocation(actor, "actor.backend", TRAIN_BACKENDS),
        parse_allocation(rollout, "rollout.backend", ROLLOUT_BACKENDS),
    )


@dataclass(frozen=True)
class Placed:
    """An allocation on the cluster: the training stages, the servers per (pool, on the actor's last machine)."""

    stages: tuple[TrainStage, ...]
    servers: dict[tuple[str, bool], int]
    split: Split


def place_as_written(
    cluster: Cluster, actor: Allocation, rollout: Allocation, split_machines: bool
) -> Placed:
    """Where upstream puts ``actor`` and ``rollout`` (see the module docstring); HexError names the backend that
    does not fit the cluster."""
    offsets, start = [], 0  # each pool's first GPU in the cluster's order
    for pool in cluster.pools:
        offsets.append(start)
        start += pool.n_gpus
    if actor.gpus > start:
        raise HexError(
            "actor.backend",
            f"{actor.text} needs {actor.gpus} GPUs; the cluster has {start}",
            "lower d, p or t so that d x p x t fits hex.cluster",
        )
    stage_gpus = actor.dp * actor.tp
    stages = []
    for k in range(actor.pp):
        first, last = k * stage_gpus, (k + 1) * stage_gpus - 1
        i = max(j for j, o in enumerate(offsets) if o <= first)
        pool = cluster.pools[i]
        if last >= offsets[i] + pool.n_gpus:
            where = f"stage {k} of {actor.pp}" if actor.pp > 1 else "the trainer"
            raise HexError(
                "actor.backend",
                f"{actor.text}: {where} takes GPUs {first}-{last} in the cluster's order, past the "
                f"{pool.n_gpus} GPUs of pool {pool.name} ({pool.gpu_type}); a stage trains on one GPU type",
                f"choose d x t (and p) so that each stage's {stage_gpus} GPUs stay inside one pool, or reorder "
                "hex.cluster.pools",
            )
        if actor.tp not in tp_degrees(pool.gpus_per_machine):
            raise HexError(
                "actor.backend",
                f"{actor.text}: t{actor.tp} does not pack pool {pool.name}'s machines of {pool.gpus_per_machine} "
                "GPUs (a tensor-parallel group stays in one machine)",
                f"use t in {tp_degrees(pool.gpus_per_machine)}",
            )
        stages.append(TrainStage(pool.name, actor.dp, actor.tp))
    trained = [max(0, min(actor.gpus - offsets[i], pool.n_gpus)) for i, pool in enumerate(cluster.pools)]
    servers, rented = _place_servers(cluster, rollout, trained, split_machines)
    train = tuple(t // p.gpus_per_machine for t, p in zip(trained, cluster.pools, strict=True))
    shared = tuple(t % p.gpus_per_machine for t, p in zip(trained, cluster.pools, strict=True))
    return Placed(tuple(stages), servers, Split(train, rented, shared))


def _place_servers(
    cluster: Cluster, rollout: Allocation, trained: list[int], split_machines: bool
) -> tuple[dict[tuple[str, bool], int], tuple[int, ...]]:
    """The rollout servers per (pool, on the actor's last machine) and the whole rollout machines per pool."""
    size, left = rollout.tp * rollout.pp, rollout.dp
    servers: dict[tuple[str, bool], int] = {}
    rented = []
    for pool, t in zip(cluster.pools, trained, strict=True):
        machines = 0
        if size in tp_degrees(pool.gpus_per_machine):
            shared = t % pool.gpus_per_machine
            if shared and split_machines and left:
                n = min(left, (pool.gpus_per_machine - shared) // size)
                servers[(pool.name, True)] = n
                left -= n
            whole = pool.machines - -(-t // pool.gpus_per_machine)
            n = min(left, whole * (pool.gpus_per_machine // size))
            if n:
                servers[(pool.name, False)] = n
                machines = -(-n * size // pool.gpus_per_machine)
                left -= n
        rented.append(machines)
    if left:
        placed = rollout.dp - left
        pools = [p for p in cluster.pools if size in tp_degrees(p.gpus_per_machine)]
        if not pools:
            degrees = sorted({d for p in cluster.pools for d in tp_degrees(p.gpus_per_machine)})
            raise HexError(
                "rollout.backend",
                f"{rollout.text}: a server of t x p = {size} GPUs packs no machine of the cluster (a server stays "
                "inside one machine)",
                f"use t x p in {degrees}",
            )
        raise HexError(
            "rollout.backend",
            f"{rollout.text} needs {rollout.dp} servers of t x p = {size} GPUs; {placed} fit on the machines left "
            "after the actor's GPUs",
            f"lower d to {placed} or less, or give the actor fewer GPUs"
            if placed
            else "give the actor fewer GPUs",
        )
    return {k: v for k, v in servers.items() if v}, tuple(rented)


def as_upstream(ev: Evaluator) -> Evaluator:
    """``ev`` at upstream's settings as written (see the module docstring), off the search's clock."""
    rl = ev.workload.rl
    # A workload whose admission is fixed (a measured run's, ``rl.max_admitted``) keeps it: the recipe's own
    # ``max_concurrent_rollouts`` there is a placeholder, and its rivals are all priced at the fixed one.
    admitted = rl.max_admitted or rl.max_concurrent_rollouts or rl.consumer_batch_size
    workload = replace(ev.workload, rl=replace(rl, max_update_window=1, max_admitted=admitted))
    cm = CostModel(ev.cluster, workload, ev.cm.calibration)
    return Evaluator(
        cm,
        ev.cluster,
        workload,
        ev.solver,
        ev.sync_strategy,
        ev.caps,
        clocked=False,
        preemption=ev.preemption,
    )


def score_as_written(
    ev: Evaluator, actor: Allocation, rollout: Allocation, split_machines: bool
) -> Evaluation:
    """``actor`` and ``rollout`` placed as upstream places them and scored by ``ev`` at upstream's settings
    (:func:`as_upstream`); HexError names the backend that does not fit the cluster or its memory."""
    ev = as_upstream(ev)
    placed = place_as_written(ev.cluster, actor, rollout, split_machines)
    estimate = ev.cm.train(placed.stages)
    if not estimate.feasible:
        raise HexError(
            "actor.backend",
            f"{actor.text} does not train on this recipe: {estimate.reason}",
            "spread a copy of the model over more GPUs (a larger t, or p on megatron; d on fsdp shards the state)",
        )
    groups = []
    for (pool, colocated), count in placed.servers.items():
        config = ev.replica_config(pool, rollout.tp, rollout.pp)
        if isinstance(config, str):
            raise HexError(
                "rollout.backend",
                f"{rollout.text} does not run on pool {pool} ({ev.cluster.pool(pool).gpu_type}): {config}",
                "choose t and p that run the model on this GPU: t dividing its attention heads, and a server's "
                "GPUs holding the weights and a KV cache",
            )
        groups.append((replace(config, colocated=colocated), count))
    return ev.score(placed.split, TrainChoice(placed.stages, estimate), [Fleet(tuple(groups), True)])
