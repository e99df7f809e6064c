"""Rollout layouts changed live (``hex.elastic.live_relayout``): a refit's re-plan that leaves training as it is,
applied machine by machine while the run goes on.

:func:`live_moves` says whether a re-plan can be applied live and what each machine does. It can when the train
stages and the machines that train are those of the running plan, and the servers of the machines that do not move
keep their in-flight caps, so that only rollout servers change: a machine that starts serving (idle before), one
whose servers change layout (two TP1 servers -> one TP2 on the same GPUs), one that stops serving.
:class:`Relayout` applies the moves in that order, one machine at a time:

1. a machine that starts serving gets its servers as a machine that joins does (``areal/join.py``);
2. a machine that changes layout does so one new server at a time (:func:`steps`): the old servers on its GPUs
   are drained (they take no new requests, the others' shares re-solved, and finish the ones they hold, for at
   most ``relayout_wait_s``), stopped (upstream's ``teardown_server``: the GPUs are freed) and retired (samples
   still on them go out again to the others), and the new server starts on those GPUs;
3. a machine that stops serving is drained and retired.

Servers started serve once they hold the trainer's next committed version, as joining ones do. A machine is taken
out only while the servers left serve at least ``min_rollout_capacity`` of the rollout capacity the run had when
the re-layout began (predicted tokens/s of the serving servers): it waits, at most ``relayout_wait_s``, for the
servers started before it to serve. A re-layout that cannot keep that floor stops, says why, and the machines not
yet moved keep their layout. Each machine moved is recorded in the plan's ``changes`` (kind ``relayout``). Once
every machine moved, the running plan becomes the new one (kind ``auto_replan``), its update window and rollouts
admitted at once holding from the next step (``HexPPOTrainer.hex_replace_plan``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from areal.utils import logging

from areal_hex_plugin.areal.elastic.health import JOINING
from areal_hex_plugin.areal.elastic.rollout import RELAYOUT
from areal_hex_plugin.areal.worker_slots import ROLLOUT_ROLE, WorkerSlot, placement_from_plan
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.replan import MachineDiff

logger = logging.getLogger("HexRelayout")

POLL_S = 0.05


def _servers(n: int) -> str:
    return f"{n} server" + ("s" if n != 1 else "")


@dataclass(frozen=True)
class Move:
    """What one machine does in a live re-layout: its role and layout before and after (``describe_role``) and the
    servers it runs after (GPU ids on the machine from 0, as the new plan numbers them; for a machine that serves
    already, ``apply_live`` renumbers them to the ids its servers hold)."""

    host: str
    before: str
    after: str
    slots: tuple[WorkerSlot, ...]

    @property
    def starts(self) -> bool:
        return self.before == "idle"

    @property
    def stops(self) -> bool:
        return not self.slots


def live_moves(running: HexPlan, new: HexPlan, diff: Sequence[MachineDiff]) -> tuple[list[Move], str | None]:
    """The machines of ``diff`` in the order a live re-layout moves them (those that start serving, those that
    change layout, those that stop), or why ``new`` cannot be applied live."""
    if [*running.train.stages] != [*new.train.stages]:
        return [], "the training stages change"
    before = {m.host: m.role for m in running.machines}
    after = {m.host: m.role for m in new.machines}
    slots = placement_from_plan(new).slots[ROLLOUT_ROLE]
    moves = []
    for d in diff:
        if before.get(d.host) not in ("rollout", "idle") or after.get(d.host) not in ("rollout", "idle"):
            return [], f"{d.host} changes role ({d.before or '(new)'} -> {d.after or '(gone)'})"
        moves.append(Move(d.host, d.before, d.after, tuple(s for s in slots if s.host == d.host)))
    kept = _kept_caps(running, new, {d.host for d in diff})
    if kept:
        return [], f"servers kept as they are change their in-flight cap ({', '.join(kept)})"
    moves.sort(key=lambda m: (not m.starts, m.stops, m.host))
    return moves, None


def _kept_caps(running: HexPlan, new: HexPlan, moved: set[str]) -> list[str]:
    """The in-flight caps ``new`` changes on servers of machines that do not move (they would restart)."""
    caps = {(g.pool, g.tp, g.pp): g.concurrency for g in new.rollout.replicas}
    out = set()
    for m in running.machines:
        if m.host in moved:
            continue
        for g in {running.rollout.replicas[gpu.group or 0] for gpu in m.gpus if gpu.role == "rollout"}:
            cap = caps.get((g.pool, g.tp, g.pp), g.concurrency)
            if cap != g.concurrency:
                out.add(f"{m.host} tp{g.tp}pp{g.pp} {g.concurrency} -> {cap}")
    return sorted(out)


@dataclass(frozen=True)
class Moved:
    """What a live re-layout did: the machines moved, and why it stopped short (None: every one)."""

    hosts: list[str]
    why_not: str | None


class Relayout:
    """Applies :func:`live_moves`' moves to a run (see the module doc): ``elastic`` is its
    :class:`~areal_hex_plugin.areal.elastic.ElasticRollout`; ``start(move, slots)`` starts servers for some of a
    move's ``slots`` (a :class:`~areal_hex_plugin.areal.join.Joined`, not attached), ``stop(rank)`` stops server
    ``rank`` and ``gpus(rank)`` gives its GPU ids, numbered as a move's slots are (a machine that changes layout);
    ``held(rank)``, the requests server ``rank`` holds (a drain waits for none; default ``elastic.in_flight``)."""

    def __init__(
        self,
        elastic,
        start: Callable[[Move, tuple[WorkerSlot, ...]], object],
        stop: Callable[[int], None],
        gpus: Callable[[int], tuple[int, ...]],
        floor: float,
        wait_s: float,
        poll_s: float = POLL_S,
        held: Callable[[int], int] | None = None,
    ) -> None:
        self.elastic, self._start, self._stop, self._gpus = elastic, start, stop, gpus
        self._held = held or elastic.in_flight
        self.floor, self.wait_s, self.poll_s = floor, wait_s, poll_s

    def apply(self, moves: Sequence[Move], reason: str) -> Moved:
        """Move each machine in turn; ``reason`` (the refit's re-plan) goes into each change recorded."""
        floor = self.floor * self.elastic.capacity()
        moved: list[str] = []
        for move in moves:
            why = self._move(move, floor, f"{reason}: {move.host} {move.before} -> {move.after}")
            if why is not None:
                logger.warning(
                    f"live re-layout stopped at {move.host}: {why}; the machines left keep their layout"
                )
                return Moved(moved, f"{move.host}: {why}")
            moved.append(move.host)
        return Moved(moved, None)

    def _move(self, move: Move, floor: float, reason: str) -> str | None:
        """One machine, one server at a time (:func:`steps`); one change recorded."""
        elastic = self.elastic
        before = elastic.capacity()
        done = _Done(floor)
        for olds, slots in steps(elastic.ranks_on(move.host), move.slots, self._gpus):
            if elastic.stopped:
                return "the run ended"
            why = self._take_out(olds, floor, done) if olds else None
            if why is None and slots:
                why = self._bring_in(move, slots, done)
            if why is not None:
                if done.started or done.stopped:  # the machine changed before it stopped
                    elastic.record(RELAYOUT, [move.host], f"{reason}: {done}; then {why}", before)
                return why
        if done.started:
            serving = self._until(lambda: all(elastic.states[r] != JOINING for r in done.started))
            done.late = 0 if serving else sum(elastic.states[r] == JOINING for r in done.started)
            done.wait_s = self.wait_s
        elastic.record(RELAYOUT, [move.host], f"{reason}: {done}", before)
        logger.info(f"live re-layout: {reason}: {done}")
        return None

    def _take_out(self, ranks: Sequence[int], floor: float, done: _Done) -> str | None:
        """Drain ``ranks`` once the servers left keep the floor (waiting for those started before to serve), stop
        and retire them."""
        elastic = self.elastic
        self._until(lambda: elastic.capacity(without=ranks) >= floor)
        left = elastic.capacity(without=ranks)
        if left < floor:
            return (
                f"without {', '.join(elastic.names[r] for r in ranks)} the servers left would serve {left:,.0f} "
                f"tokens/s, below the floor of {floor:,.0f} (hex.elastic.min_rollout_capacity={self.floor:g} of "
                f"{floor / self.floor:,.0f})"
            )
        start = time.monotonic()
        elastic.drain(ranks)
        self._until(lambda: all(self._held(rank) == 0 for rank in ranks))
        for rank in ranks:
            try:
                self._stop(rank)
            except Exception as error:  # it may have died meanwhile: it is retired all the same
                logger.warning(f"cannot stop rollout server {elastic.names[rank]} ({error})")
        done.held += elastic.retire(ranks)
        done.stopped += len(ranks)
        done.drain_s = max(done.drain_s, time.monotonic() - start)
        done.left = min(done.left, left)
        return None

    def _bring_in(self, move: Move, slots: tuple[WorkerSlot, ...], done: _Done) -> str | None:
        try:
            joined = self._start(move, slots)
        except Exception as error:  # their GPUs are free; the machine serves with what it has
            return f"its servers did not start ({error})"
        done.started.extend(self.elastic.add_started(joined, RELAYOUT))
        return None

    def _until(self, done: Callable[[], bool]) -> bool:
        """Wait until ``done()``, at most ``wait_s`` and never past the run's end; whether it came."""
        deadline = time.monotonic() + self.wait_s
        while not done():
            if time.monotonic() >= deadline or self.elastic.stopped:
                return False
            time.sleep(self.poll_s)
        return True


def steps(
    ranks: Sequence[int], slots: Sequence[WorkerSlot], gpus: Callable[[int], tuple[int, ...]]
) -> list[tuple[tuple[int, ...], tuple[WorkerSlot, ...]]]:
    """A machine's moves as (servers taken out, servers started) steps: new servers on GPUs no old server holds
    start first, together; then each other new server once the old servers on its GPUs are out; then the old
    servers left are taken out."""
    held = {rank: set(gpus(rank)) for rank in ranks}
    free = tuple(s for s in slots if not any(held[r] & set(s.gpu_ids) for r in ranks))
    out = [((), free)] if free else []
    left = list(ranks)
    for slot in slots:
        if slot not in free:
            olds = tuple(r for r in left if held[r] & set(slot.gpu_ids))
            left = [r for r in left if r not in olds]
            out.append((olds, (slot,)))
    return out + ([(tuple(left), ())] if left else [])


@dataclass
class _Done:
    """What one machine's move did so far, said in its change's reason."""

    floor: float
    stopped: int = 0
    held: int = 0
    drain_s: float = 0.0
    left: float = float("inf")
    started: list[int] = field(default_factory=list)
    late: int = 0
    wait_s: float = 0.0

    def __str__(self) -> str:
        said = []
        if self.stopped:
            said.append(
                f"{_servers(self.stopped)} drained (at most {self.drain_s:.1f} s) and stopped ({self.held} samples "
                f"went out again to the others; the servers left served at least {self.left:,.0f} tokens/s, the "
                f"floor {self.floor:,.0f})"
            )
        if self.started:
            late = f", {self.late} not serving after {self.wait_s:g} s" if self.late else ""
            said.append(f"{_servers(len(self.started))} started{late}")
        return "; ".join(said) or "nothing"


def live_why_not(config) -> str | None:
    """Why a run of upstream ``config`` cannot re-lay out its rollout servers live (None: it can)."""
    from areal_hex_plugin.areal.rewrite import uses_relay

    elastic = config.hex.elastic
    if not elastic.live_relayout:
        return "hex.elastic.live_relayout is false"
    if not elastic.enabled:
        return "hex.elastic.enabled is false"
    if config.scheduler.type != "hex_local":
        return f"servers start mid-run on hex_local only (scheduler.type: {config.scheduler.type})"
    if not uses_relay(config):
        return "a server started mid-run receives the weights over the relay only (hex.transport: relay)"
    return None


def apply_live(trainer, decision, refit_step: int) -> str | None:
    """Apply the refit's re-plan ``decision`` to ``trainer``'s run live (the module doc); the running plan then
    becomes the new one, the change recorded (kind ``auto_replan``). None when every machine moved; else why
    not, where nothing or only some machines moved."""
    from areal_hex_plugin.areal.auto_replan import applied_plan, budget_spent

    config = trainer.config.hex.elastic
    elastic, rollout, running = trainer.hex_elastic, trainer.rollout, trainer.hex_plan
    why = live_why_not(trainer.config)
    if why is None:
        why = budget_spent(running, config.max_auto_replans)
    if why is not None or elastic is None:
        return why or "no elastic run"
    moves, why = live_moves(decision.running, decision.plan, decision.diff)
    if why is not None:
        return why
    try:
        moves = [m if m.starts else _numbered(trainer, running, m) for m in moves]
    except ValueError as error:
        return str(error)
    relayout = Relayout(
        elastic,
        lambda move, slots: _start(trainer, move, slots),
        rollout.hex_stop_server,
        lambda rank: rollout._slots()[rank].gpu_ids,
        config.min_rollout_capacity,
        config.relayout_wait_s,
        held=trainer.hex_in_flight,
    )
    moved = relayout.apply(moves, f"refit at step {refit_step}")
    if moved.why_not is not None:
        return f"stopped after {len(moved.hosts)} of {len(moves)} machines: {moved.why_not}"
    trainer.hex_replace_plan(
        lambda now: applied_plan(now, decision, refit_step, elastic.step, config.max_auto_replans, live=True)
    )
    return None


def _numbered(trainer, running: HexPlan, move: Move) -> Move:
    """``move`` with its new servers on the run's ids of the machine's GPUs (``running`` numbers them from 0)."""
    slots = trainer.rollout._slots()
    held = sorted(i for rank in trainer.hex_elastic.ranks_on(move.host) for i in slots[rank].gpu_ids)
    (machine,) = (m for m in running.machines if m.host == move.host)
    planned = sorted(g.gpu for g in machine.gpus if g.role == "rollout")
    if len(held) != len(planned):
        raise ValueError(
            f"{move.host}'s servers hold {len(held)} GPUs, the running plan gives it {len(planned)}"
        )
    ids = dict(zip(planned, held, strict=True))
    missing = sorted({i for s in move.slots for i in s.gpu_ids} - set(ids))
    if missing:
        raise ValueError(f"the new layout uses GPUs {missing} of {move.host}, which served on {planned}")
    return replace(
        move, slots=tuple(replace(s, gpu_ids=tuple(ids[i] for i in s.gpu_ids)) for s in move.slots)
    )


def _start(trainer, move: Move, slots: tuple[WorkerSlot, ...]):
    """``slots``' servers started, numbered after the run's servers; a machine that starts serving gets GPUs of
    this node no worker holds, as a machine that joins does."""
    from areal_hex_plugin.areal.join import local_gpu_counts, on_this_node, start_servers
    from areal_hex_plugin.areal.rewrite import flagged

    rollout = trainer.rollout
    first = len(rollout.workers)
    slots = tuple(replace(s, index=first + k, share=0.0) for k, s in enumerate(slots))
    if move.starts:
        where = f"live re-layout of {move.host}"
        slots = on_this_node(slots, rollout.scheduler.placement, local_gpu_counts(), where)
    return start_servers(trainer, flagged(slots, trainer.config), f"relayout{first}")
