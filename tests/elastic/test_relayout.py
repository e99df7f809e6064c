"""Live re-layouts (``areal/elastic/relayout.py``) on the elastic rig: real stand-in HTTP servers, the real router,
cost model and staleness manager; starting and stopping a server are the functions the tests give."""

from __future__ import annotations

import re
import threading
from dataclasses import replace

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.areal.elastic import DOWN, JOINING, UP  # noqa: E402
from areal_hex_plugin.areal.elastic.health import DRAINING, RETIRED  # noqa: E402
from areal_hex_plugin.areal.elastic.relayout import RELAYOUT, Move, Relayout, live_moves, steps  # noqa: E402
from areal_hex_plugin.areal.join import Joined  # noqa: E402
from areal_hex_plugin.areal.worker_slots import ROLLOUT_ROLE, WorkerSlot  # noqa: E402
from areal_hex_plugin.planner.replan import machine_diff  # noqa: E402
from tests.e2e.run import SMALL_BELIEVED_FAST  # noqa: E402
from tests.elastic.rig import versioned_standin, wait  # noqa: E402

TINY = "recipes/ci/tiny.yaml"


def _slot(host: str, pool: str, tp: int, gpus: tuple[int, ...]) -> WorkerSlot:
    return WorkerSlot(ROLLOUT_ROLE, 0, pool, f"CPU-{pool.upper()}", host, gpus, tp=tp)


class _Machines:
    """The controller's side: each move's servers started as stand-ins (one per slot), servers stopped."""

    def __init__(self, elastic, router) -> None:
        self.elastic, self.router = elastic, router
        self.started: list = []
        self.stopped: list[int] = []
        self.events: list[str] = []

    def start(self, move: Move, slots: tuple[WorkerSlot, ...]) -> Joined:
        servers = [versioned_standin(s.tp) for s in slots]
        self.started.extend(servers)
        self.events.append(f"start {move.host} {[s.gpu_ids for s in slots]}")
        first = len(self.elastic.names)
        slots = tuple(replace(s, index=first + k) for k, s in enumerate(slots))

        def attach() -> None:
            for _ in slots:
                self.router.add_server()

        return Joined(slots, [s.address for s in servers], attach)

    def stop(self, rank: int) -> None:
        self.stopped.append(rank)
        self.events.append(f"stop {rank}")

    def close(self) -> None:
        for server in self.started:
            server.close()

    def relayout(self, floor: float, wait_s: float, start=None) -> Relayout:
        # The rig's servers: big-2's on GPU 0 of big-2, small-0's tp2 on GPUs 0 and 1 of small-0.
        gpus = [(0,), (0, 1)]
        return Relayout(self.elastic, start or self.start, self.stop, gpus.__getitem__, floor, wait_s)


@pytest.fixture
def machines(rig):
    elastic, router, *_ = rig
    made = _Machines(elastic, router)
    yield made
    made.close()


def _serve(elastic, machines: _Machines, version: int) -> None:
    """The trainer commits ``version`` to every server started so far."""
    for server in machines.started:
        server.weight_version = str(version)
    elastic.on_version(version)


def test_a_machine_changes_layout_while_its_requests_finish(rig, servers, machines):
    elastic, router, changes, relaunched, _ = rig
    elastic.start()
    while (rank := router.choose()) != 1:  # a request small-0 holds
        router.release(rank)
    assert router.outstanding == [0, 1]
    move = Move(
        "small-0",
        "rollout tp2pp1 x1",
        "rollout tp1pp1 x2",
        (_slot("small-0", "small", 1, (0,)), _slot("small-0", "small", 1, (1,))),
    )
    relayout = machines.relayout(floor=0.3, wait_s=10)
    done = []
    thread = threading.Thread(target=lambda: done.append(relayout.apply([move], "refit at step 4")))
    thread.start()
    # Drained: no new request goes to it, the one it holds finishes there; nothing is stopped before.
    wait(lambda: elastic.states[1] == DRAINING, 5)
    assert router.shares == [1.0, 0.0] and machines.stopped == []
    assert all(router.choose() == 0 for _ in range(4))
    router.release(1)
    wait(lambda: len(elastic.states) == 4, 5)
    assert machines.stopped == [1] and elastic.states == [UP, RETIRED, JOINING, JOINING]
    # The stopped server is neither probed, nor called, nor relaunched, though it no longer answers.
    servers[1].close()
    elastic.confirm_failure(1)
    assert not elastic.reachable(1) and elastic.health.to_probe() == [0, 2, 3]
    assert relaunched == [] and elastic.counts["lost"] == 0
    # The new servers serve once they hold the trainer's next version; then the machine counts as moved.
    _serve(elastic, machines, 1)
    thread.join(10)
    ((moved),) = done
    assert moved.hosts == ["small-0"] and moved.why_not is None
    assert elastic.states == [UP, RETIRED, UP, UP] and router.shares[1] == 0
    assert router.shares[2] == pytest.approx(router.shares[3]) and router.shares[2] > 0
    kinds = [(c.kind, c.hosts) for c in changes]
    assert kinds == [("gained", ["small-0/2"]), ("gained", ["small-0/3"]), (RELAYOUT, ["small-0"])]
    change = changes[-1]
    assert change.reason.startswith(
        "refit at step 4: small-0 rollout tp2pp1 x1 -> rollout tp1pp1 x2: 1 server drained"
    )
    assert "0 samples went out again" in change.reason and "2 servers started" in change.reason
    left, floor = (
        float(x.replace(",", ""))
        for x in re.findall(r"left served at least ([\d,]+) tokens/s, the floor ([\d,]+)", change.reason)[0]
    )
    assert left >= floor > 0
    assert change.shares["small-0/1"] == 0 and change.tokens_per_s_after > 0
    assert elastic.summary()["retired"] == 1


def test_a_machine_is_not_taken_out_below_the_floor(rig, machines):
    elastic, router, changes, _, _ = rig
    move = Move("small-0", "rollout tp2pp1 x1", "rollout tp1pp1 x2", (_slot("small-0", "small", 1, (0,)),))
    # Without small-0, big-2 alone serves this fraction of what both serve.
    alone = elastic.capacity(without=[1]) / elastic.capacity()
    assert 0 < alone < 1
    moved = machines.relayout(floor=alone + 0.05, wait_s=0.3).apply([move], "r")
    assert (
        moved.hosts == [] and "below the floor" in moved.why_not and "min_rollout_capacity" in moved.why_not
    )
    assert elastic.states == [UP, UP] and router.shares == [0.5, 0.5]
    assert machines.events == [] and changes == []


def test_a_machine_waits_for_the_servers_started_before_it(rig, machines):
    """big-3 starts serving first; small-0 is taken out only once big-3 serves (the floor holds only with it)."""
    elastic, router, changes, _, _ = rig
    alone = elastic.capacity(without=[1]) / elastic.capacity()
    gained = Move("big-3", "idle", "rollout tp1pp1 x1", (_slot("big-3", "big", 1, (0,)),))
    stops = Move("small-0", "rollout tp2pp1 x1", "idle", ())
    relayout = machines.relayout(floor=alone + 0.05, wait_s=10)
    done = []
    thread = threading.Thread(target=lambda: done.append(relayout.apply([gained, stops], "refit at step 8")))
    thread.start()
    wait(lambda: len(elastic.states) == 3, 5)
    threading.Event().wait(0.3)
    assert elastic.states == [UP, UP, JOINING] and machines.stopped == []  # small-0 still serves
    _serve(elastic, machines, 2)
    thread.join(10)
    ((moved),) = done
    assert (moved.hosts, moved.why_not) == (["big-3", "small-0"], None)
    assert machines.events == ["start big-3 [(0,)]", "stop 1"] and elastic.states == [UP, RETIRED, UP]
    assert router.shares[1] == 0 and [c.kind for c in changes] == ["gained", RELAYOUT, RELAYOUT]
    assert "servers started" not in changes[-1].reason and "drained" in changes[-1].reason


def test_a_server_that_does_not_start_stops_the_relayout(rig, machines):
    elastic, router, changes, _, _ = rig

    def fail(move, slots):
        raise RuntimeError("no free GPU")

    starts = [
        Move("big-3", "idle", "rollout tp1pp1 x1", (_slot("big-3", "big", 1, (0,)),)),
        Move("big-4", "idle", "rollout tp1pp1 x1", (_slot("big-4", "big", 1, (0,)),)),
    ]
    moved = machines.relayout(floor=0.3, wait_s=1, start=fail).apply(starts, "r")
    assert moved.hosts == [] and moved.why_not == "big-3: its servers did not start (no free GPU)"
    assert changes == [] and elastic.states == [UP, UP]  # nothing changed
    # After its old server was taken out: recorded, the machine stays out, the others serve.
    change = Move("small-0", "rollout tp2pp1 x1", "rollout tp1pp1 x2", (_slot("small-0", "small", 1, (0,)),))
    moved = machines.relayout(floor=0.3, wait_s=1, start=fail).apply([change], "r")
    assert moved.why_not == "small-0: its servers did not start (no free GPU)"
    assert elastic.states == [UP, RETIRED] and router.shares == [1.0, 0.0]
    ((kind, reason),) = [(c.kind, c.reason) for c in changes]
    assert kind == RELAYOUT and reason.startswith(
        "r: small-0 rollout tp2pp1 x1 -> rollout tp1pp1 x2: 1 server"
    )
    assert reason.endswith("; then its servers did not start (no free GPU)")


def test_a_run_that_ends_stops_the_relayout(rig, machines):
    elastic, *_ = rig
    elastic.stop()
    move = Move("small-0", "rollout tp2pp1 x1", "idle", ())
    moved = machines.relayout(floor=0.1, wait_s=5).apply([move], "r")
    assert moved.why_not == "small-0: the run ended" and machines.events == []
    assert DOWN not in elastic.states


def test_a_machine_changes_layout_one_new_server_at_a_time():
    """Eight tp1 servers on GPUs 0-7 become two tp2 servers on 0-3 and a tp4 on 4-7: each new server takes out
    only the old servers on its GPUs; a new server on GPUs nobody holds starts first; old servers on GPUs no new
    server uses go last."""
    held = {rank: (rank,) for rank in range(8)}
    new = [_slot("m", "big", 2, (0, 1)), _slot("m", "big", 2, (2, 3)), _slot("m", "big", 4, (4, 5, 6, 7))]
    assert steps(range(8), new, held.__getitem__) == [
        ((0, 1), (new[0],)),
        ((2, 3), (new[1],)),
        ((4, 5, 6, 7), (new[2],)),
    ]
    spare = _slot("m", "big", 1, (9,))
    assert steps([0, 1], [new[0], spare], held.__getitem__)[0] == ((), (spare,))
    assert steps([0, 1, 2], [spare], held.__getitem__) == [((), (spare,)), ((0, 1, 2), ())]


# -- which re-plans apply live -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def believed_and_true():
    from areal_hex_plugin.planner import plan_recipe
    from areal_hex_plugin.specs.recipe import load_recipe

    return plan_recipe(load_recipe(TINY, [SMALL_BELIEVED_FAST])), plan_recipe(load_recipe(TINY))


def test_a_replan_that_leaves_training_is_applied_machine_by_machine(believed_and_true):
    running, new = believed_and_true
    moves, why = live_moves(running, new, machine_diff(running, new))
    assert why is None
    assert [(m.host, m.before, m.after) for m in moves] == [
        ("big-2", "idle", "rollout tp1pp1 x1"),  # starts serving first
        ("small-0", "rollout tp1pp1 x2", "rollout tp2pp1 x1"),
    ]
    assert [(s.host, s.gpu_ids, s.tp, s.concurrency > 0) for m in moves for s in m.slots] == [
        ("big-2", (0,), 1, True),
        ("small-0", (0, 1), 2, True),
    ]
    back, why = live_moves(new, running, machine_diff(new, running))
    assert why is None and [(m.host, m.stops) for m in back] == [("small-0", False), ("big-2", True)]


def test_a_replan_that_moves_training_or_restarts_kept_servers_is_not_live(believed_and_true):
    running, new = believed_and_true
    trains = replace(
        new, machines=[replace(m, role="train") if m.host == "big-2" else m for m in new.machines]
    )
    assert live_moves(running, trains, machine_diff(running, trains))[1].startswith(
        "big-2 changes role (idle -> train"
    )
    # The window and admission move with it (applied once every machine moved); kept servers' caps cannot.
    wider = replace(new, solver=replace(new.solver, window_steps=new.solver.window_steps + 1))
    assert live_moves(running, wider, machine_diff(running, wider))[1] is None
    groups = [replace(g, concurrency=g.concurrency + 1) for g in new.rollout.replicas]
    capped = replace(new, rollout=replace(new.rollout, replicas=groups))
    (small,) = [g for g in new.rollout.replicas if g.pool == "small"]
    assert live_moves(new, capped, [])[1] == (
        "servers kept as they are change their in-flight cap (big-2 tp1pp1 "
        f"{groups[0].concurrency - 1} -> {groups[0].concurrency}, small-0 tp2pp1 {small.concurrency} -> "
        f"{small.concurrency + 1})"
    )
    stages = replace(new, train=replace(new.train, stages=[replace(new.train.stages[0], dp=3)]))
    assert live_moves(running, stages, machine_diff(running, stages))[1] == "the training stages change"
