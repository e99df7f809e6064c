"""A machine that joins a running plan (``areal-hex join``, ``joins.py``): its rollout servers, started through the
run's scheduler.

:func:`machine_slots` says which servers the machine runs: a machine the plan placed (its servers lost since) runs
its planned servers on its GPUs again; a new or idle machine runs its pool's planned replica shape (the plan's
fastest per GPU there, else the cost model's: ``planner/replan.gained_shape``, as ``areal-hex replan --gained``
places it), as many as its GPUs hold. :func:`join_machine` starts them (a worker per server under a scheduler role
of their own, upstream's engine, its server with the slot's flags) and hands back what the elastic watcher
attaches: the controller's workers, routing (share 0) and the relay's pools. The watcher then keeps each server out
of the routing until it holds the trainer's next committed version (``areal/elastic/``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from areal_hex_plugin.areal.worker_slots import ROLLOUT_ROLE, TRAIN_ROLE, Placement, WorkerSlot
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.joins import JoinRequest, tag
from areal_hex_plugin.planner.reshare import ServerShape


@dataclass
class Joined:
    """Servers started for a join, not yet attached: ``attach()`` adds them to the controller and the relay."""

    slots: tuple[WorkerSlot, ...]
    addresses: list[str]
    attach: Callable[[], None]

    @property
    def shapes(self) -> list[ServerShape]:
        # At their in-flight caps, as the planned servers are scored (areal/elastic/), so a joined server of a
        # planned shape gets that shape's share.
        return [ServerShape(s.pool, s.tp, s.pp, s.concurrency or None) for s in self.slots]

    @property
    def names(self) -> list[str]:
        return [f"{s.host}/{s.index}" for s in self.slots]


def machine_slots(cm, plan, placement: Placement, request: JoinRequest, first_rank: int, flags) -> tuple:
    """The servers ``request``'s machine runs, ranked from ``first_rank``, and whether it is new to the plan
    (its ``gpu_ids`` then count from 0 on the machine). ``flags(slots)`` adds each server's SGLang flags."""
    old = [s for s in placement.slots[ROLLOUT_ROLE] if s.host == request.host]
    if old:  # the same machine back: its planned servers on its GPUs
        return tuple(replace(s, index=first_rank + k) for k, s in enumerate(old)), False
    if any(s.host == request.host for s in placement.slots[TRAIN_ROLE]):
        raise HexError(tag(request.index), f"{request.host} trains in this run", "name another machine")
    from areal_hex_plugin.planner.replan import gained_shape

    pool = cm.cluster.pool(request.pool)
    shape = gained_shape(cm, plan, pool)
    template = next(
        (s for s in placement.slots[ROLLOUT_ROLE] if (s.pool, s.tp, s.pp) == (pool.name, shape.tp, shape.pp)),
        None,
    )
    if template is None:
        bare = WorkerSlot(
            ROLLOUT_ROLE, 0, pool.name, pool.gpu_type, request.host, (), tp=shape.tp, pp=shape.pp
        )
        (template,) = flags((replace(bare, concurrency=shape.concurrency),))
    size = shape.tp * shape.pp
    slots = tuple(
        replace(
            template,
            index=first_rank + k,
            host=request.host,
            gpu_ids=tuple(range(k * size, (k + 1) * size)),
            share=0.0,
        )
        for k in range(pool.gpus_per_machine // size)
    )
    return slots, True


def on_this_node(slots: tuple, placement: Placement, have: dict[str, int], where: str) -> tuple:
    """hex_local: a new machine's servers on this node's GPU ids that no worker of the run holds; this node must
    have that many GPUs of the type beyond those (``HEX_LOCAL_GPUS`` declares them on a CPU machine). ``where``
    names the request in the error."""
    taken: dict[str, set[int]] = defaultdict(set)
    for role_slots in placement.slots.values():
        for s in role_slots:
            taken[s.gpu_type].update(s.gpu_ids)
    gpu_type = slots[0].gpu_type
    need = sum(len(s.gpu_ids) for s in slots)
    if len(taken[gpu_type]) + need > have.get(gpu_type, 0):
        raise HexError(
            where,
            f"this node has {have.get(gpu_type, 0)} {gpu_type} GPUs and the run holds {len(taken[gpu_type])}; "
            f"the machine needs {need} more",
            "free GPUs of that type on this node (hex_local lays every machine on it)",
        )
    used = {i for ids in taken.values() for i in ids}
    free = iter(i for i in range(sum(have.values())) if i not in used)
    return tuple(replace(s, gpu_ids=tuple(next(free) for _ in s.gpu_ids)) for s in slots)


def local_gpu_counts() -> dict[str, int]:
    """This node's GPUs per type, as ``hex_local``'s start-up check counts them."""
    from areal_hex_plugin.inventory import canonical_gpu_type, machines_from_local
    from areal_hex_plugin.specs.catalog import build_catalog

    catalog = build_catalog()
    have: dict[str, int] = defaultdict(int)
    for m in machines_from_local():
        have[canonical_gpu_type(m.gpu_name, catalog)] += m.gpus
    return dict(have)


def join_machine(trainer, request: JoinRequest, busy: set[str]) -> Joined:
    """Start ``request``'s machine's servers for ``trainer``'s rollout (``busy``: hosts with a server not lost)."""
    from areal_hex_plugin.areal.rewrite import flagged

    rollout = trainer.rollout
    if not getattr(rollout.scheduler, "hex_joins_machines", False):
        raise HexError(
            tag(request.index),
            f"machines join a running plan on hex_local only (this run: {type(rollout.scheduler).__name__})",
            "stop the run, then resume it on areal-hex replan --plan PLAN.json --gained POOL=HOST",
        )
    if request.host in busy:
        raise HexError(tag(request.index), f"{request.host} serves in this run", "name another machine")
    session = trainer.hex_session
    if request.pool not in {p.name for p in session.recipe.cluster.pools}:
        raise HexError(tag(request.index), f"pool {request.pool!r} is not in the recipe", "name a pool of it")
    cm = session.cost_model()
    placement = rollout.scheduler.placement
    slots, new = machine_slots(
        cm, trainer.hex_plan, placement, request, len(rollout.workers), lambda s: flagged(s, trainer.config)
    )
    if new:
        slots = on_this_node(slots, placement, local_gpu_counts(), tag(request.index))
    return start_servers(trainer, slots, f"join{request.index}")


def start_servers(trainer, slots: tuple[WorkerSlot, ...], name: str) -> Joined:
    """Start ``slots``' servers for ``trainer``'s rollout, each on a worker of the scheduler role
    ``<rollout role>-<name>`` (with an eval-rollout worker beside it where the run evaluates); attached (routing,
    relay pools) by the :class:`Joined`'s ``attach``."""
    from areal_hex_plugin.areal.transport_setup import with_servers

    rollout, actor, evaluation = trainer.rollout, trainer.actor, trainer.eval_rollout
    role = f"{rollout._worker_role}-{name}"
    workers, infos = rollout.hex_start_servers(slots, role)
    beside = evaluation.hex_start_beside(role, slots, infos) if evaluation is not None else None
    train = rollout.scheduler.placement.slots[TRAIN_ROLE]

    def attach() -> None:
        settings = getattr(actor, "hex_settings", None)
        if settings is not None:
            with_servers(settings, slots, trainer.hex_session.recipe.cluster, train)
        rollout.hex_attach(slots, workers, infos)
        if beside is not None:
            evaluation.hex_attach_beside(slots, beside)

    return Joined(slots, [f"{info.host}:{info.port}" for info in infos], attach)
