"""``areal/elastic/`` on its own: real HTTP servers (the transport tests' SGLang stand-in), the real router,
cost model and upstream's StalenessManager; the controller's calls are the functions it is given."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("areal")

import torch  # noqa: E402

from areal_hex_plugin.areal.elastic import DOWN, JOINING, UP, output_lengths  # noqa: E402
from areal_hex_plugin.areal.join import Joined  # noqa: E402
from areal_hex_plugin.areal.worker_slots import ROLLOUT_ROLE, WorkerSlot  # noqa: E402
from areal_hex_plugin.joins import JOIN_FILE, append_request  # noqa: E402
from tests.elastic.plans import elastic_recipe, two_layout_plan  # noqa: E402
from tests.elastic.rig import CONFIG, versioned_standin, wait  # noqa: E402


@dataclass
class Task:
    task_id: int


@dataclass
class Result:
    task_id: int
    trajectory: dict


def test_a_silent_server_leaves_the_routing_within_the_deadline(rig, servers):
    elastic, router, changes, relaunched, _ = rig
    elastic.start()
    time.sleep(0.3)
    assert elastic.states == [UP, UP]
    servers[1].close()
    waited = wait(lambda: elastic.states[1] != UP, elastic.deadline_s + 1)
    assert waited <= elastic.deadline_s
    wait(lambda: changes, 5)  # marked down under the lock; the shares and the change follow inside it
    assert router.shares == [1.0, 0.0]
    (change,) = changes
    assert (change.kind, change.hosts, change.shares) == (
        "lost",
        ["small-0/1"],
        {"big-2/0": 1.0, "small-0/1": 0.0},
    )
    assert change.tokens_per_s_after < change.tokens_per_s_before
    # Relaunched on its machine: it joins the relay route but takes no request until it holds the version.
    wait(lambda: elastic.states[1] == JOINING, 5)
    rerouted = []
    elastic._reroute = rerouted.append
    elastic.before_update()
    assert rerouted == [[True, True]]
    elastic.on_version(1)  # it still serves "default"
    assert elastic.states[1] == JOINING and router.shares[1] == 0.0
    relaunched[0].weight_version = "1"
    elastic.on_version(1)
    assert elastic.states[1] == UP and 0 < router.shares[1] < 1
    assert [c.kind for c in changes] == ["lost", "gained"]
    assert changes[-1].shares == pytest.approx(
        dict(zip(["big-2/0", "small-0/1"], router.shares, strict=True))
    )


def _trajectory(lengths: list[int]) -> dict:
    mask = torch.zeros(len(lengths), 32, dtype=torch.int32)
    for row, n in enumerate(lengths):
        mask[row, 8 : 8 + n] = 1
    return {"loss_mask": mask}


def test_output_lengths_come_from_the_loss_mask():
    assert output_lengths(_trajectory([3, 7])) == [3, 7]
    assert output_lengths({}) == [] and output_lengths(None) == []


def test_a_lost_servers_sample_goes_out_again_once(rig, servers):
    elastic, router, _, _, manager = rig
    elastic._relaunch = None
    forgotten, tried = [], []

    async def attempt(task):
        rank = router.choose()
        elastic.picked(rank)
        tried.append((task.task_id, rank))
        try:
            if rank == 1:
                await asyncio.sleep(60)  # the lost server never answers
            return Result(task.task_id, _trajectory([4, 4]))
        finally:
            router.release(rank)

    async def scenario():
        ids = iter(range(100, 200))
        first = asyncio.ensure_future(elastic.submit(Task(1), attempt, lambda: next(ids), forgotten.append))
        second = asyncio.ensure_future(elastic.submit(Task(2), attempt, lambda: next(ids), forgotten.append))
        await asyncio.sleep(0.3)
        elastic.mark_down(1, "test")
        return await asyncio.gather(first, second)

    results = asyncio.run(scenario())
    assert all(r is not None for r in results)
    assert [t for t, r in tried if r == 1] == forgotten  # the attempt on the lost server was cancelled
    assert elastic.counts["resubmitted"] == elastic.counts["in_flight_at_loss"] == 1
    assert elastic.summary()["accepted"] == 2 and elastic.counts["duplicates"] == 0
    assert manager.rollout_stat.rejected == 0


def test_a_failure_on_a_live_server_is_rejected_once(rig):
    elastic, router, _, _, manager = rig
    manager.on_rollout_enqueued()
    manager.on_rollout_submitted()

    async def attempt(task):
        rank = router.choose()
        elastic.picked(rank)
        router.release(rank, completed=False)
        elastic.manager(manager).on_rollout_rejected()  # as upstream's submit-then-wait does
        return None

    assert asyncio.run(elastic.submit(Task(1), attempt, lambda: 2, lambda _: None)) is None
    assert manager.rollout_stat.rejected == 1 and manager.rollout_stat.running == 0
    assert elastic.counts["resubmitted"] == 0 and elastic.states == [UP, UP]


def test_doubled_lengths_rebalance_the_shares(rig, tmp_path):
    elastic, router, changes, _, _ = rig
    elastic._lengths = [4] * 16
    elastic.step_metrics()  # the plan assumed ~11 tokens: re-balanced to 4
    shares_at_4 = list(router.shares)
    assert [c.kind for c in changes] == ["drift"]
    elastic._lengths = [8] * 16
    metrics = elastic.step_metrics()
    assert metrics["hex/elastic/drift"] > CONFIG.drift_threshold
    assert [c.kind for c in changes] == ["drift", "drift"] and changes[-1].step == 1
    assert router.shares != shares_at_4 and sum(router.shares) == pytest.approx(1.0)
    assert (tmp_path / "lengths.txt").read_text().split() == ["8"] * 16
    elastic._lengths = [8] * 16
    assert abs(elastic.step_metrics()["hex/elastic/drift"]) < 1e-9  # steady: nothing more moves
    assert len(changes) == 2
    assert metrics["hex/elastic/live_servers"] == 2.0


def test_a_drift_logs_the_planners_suggestion_and_its_gain(rig, tmp_path):
    from areal_hex_plugin.plan import HexPlan
    from areal_hex_plugin.planner.replan import replan_for_lengths

    elastic, router, changes, _, _ = rig
    recipe = elastic_recipe()
    plan = HexPlan.load(two_layout_plan(tmp_path, "hex_local"))
    elastic.advisor.suggest = lambda workload: replan_for_lengths(recipe, plan, workload)
    elastic._lengths = [4] * 16
    assert "hex/elastic/replan_gain" not in elastic.step_metrics()
    wait(lambda: elastic.suggested_gain is not None, 30)
    elastic._lengths = [4] * 16
    assert elastic.step_metrics()["hex/elastic/replan_gain"] == elastic.suggested_gain


def test_a_relaunch_that_fails_leaves_the_server_out(rig, servers):
    elastic, router, changes, _, _ = rig

    tried = []

    def fail(rank):
        tried.append(rank)
        raise RuntimeError("machine gone")

    elastic._relaunch = fail
    elastic.mark_down(0, "test")
    for thread in threading.enumerate():  # the relaunch runs off the caller's thread: wait for it to end
        if thread.name == "hex-relaunch":
            thread.join(5)
    assert tried == [0]
    assert elastic.states == [DOWN, UP] and router.shares == [0.0, 1.0]
    assert elastic.counts["relaunched"] == 0
    assert [(c.kind, c.hosts, c.shares) for c in changes] == [
        ("lost", ["big-2/0"], {"big-2/0": 0.0, "small-0/1": 1.0})
    ]


def test_the_last_serving_server_stays_in_the_routing(rig):
    """Found in a CI run on an overloaded machine: both servers failed their probes, the first was relaunched and
    waited for the trainer's next version, the second was taken out too, and nothing served that version's
    rollouts (the run hung until killed). The last server that serves is kept, whatever its probes say."""
    elastic, router, changes, _, _ = rig
    elastic._relaunch = None
    elastic.mark_down(0, "test")
    for _ in range(CONFIG.failures_to_down + 1):
        elastic._after_probe(1, False)
    elastic.mark_down(1, "a request failed and its server does not answer")
    assert elastic.states == [DOWN, UP] and router.shares == [0.0, 1.0]
    assert [c.kind for c in changes] == ["lost"] and elastic.counts["lost"] == 1


def test_a_last_server_that_stays_silent_ends_the_run_with_one_message(rig, servers):
    """Kept while it fails, the last server that neither answers a probe nor finishes a sample for ``stall_s``
    ends the run (nothing else could ever serve the trainer's next version): once, through the driver's
    ``end_run``. One that answers again meanwhile starts its count afresh."""
    elastic, router, changes, _, _ = rig
    ended = []
    elastic._relaunch, elastic._end_run, elastic.stall_s = None, ended.append, 0.6
    elastic.mark_down(0, "test")
    for _ in range(CONFIG.failures_to_down + 1):
        elastic._after_probe(1, False)
    elastic._after_probe(1, True)  # it answers again: no longer kept
    time.sleep(0.7)
    for _ in range(CONFIG.failures_to_down + 1):
        elastic._after_probe(1, False)
    assert ended == [] and elastic.states == [DOWN, UP]
    servers[1].close()
    elastic.start()
    wait(lambda: ended, 10)
    time.sleep(0.5)
    (error,) = ended
    assert error.field == "rollout servers" and error.problem.startswith(
        "none can serve: small-0/1, the last one serving, has answered no health probe and finished no sample for"
    )
    assert "run the same command again" in error.fix and elastic.states == [DOWN, UP]


def test_a_cancelled_sample_cancels_its_attempt(rig):
    elastic, router, _, _, _ = rig
    cancelled = []

    async def attempt(task):
        rank = router.choose()
        elastic.picked(rank)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(task.task_id)
            raise
        finally:
            router.release(rank, completed=False)

    async def scenario():
        outer = asyncio.ensure_future(elastic.submit(Task(1), attempt, lambda: 2, lambda _: None))
        await asyncio.sleep(0.2)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0.05)  # the attempt's own cancellation runs in its task

    asyncio.run(scenario())
    assert cancelled == [1] and router.outstanding == [0, 0]


def test_a_machine_that_joins_serves_once_it_holds_the_version(rig, tmp_path):
    elastic, router, changes, started, _ = rig
    joins = tmp_path / JOIN_FILE
    append_request(joins, "small", "small-7")  # before the run: set aside, never started
    asked = []

    def join(request, busy):
        asked.append((request, busy))
        if request.host == "small-9":
            raise RuntimeError("no such machine")
        server = versioned_standin()
        started.append(server)
        slot = WorkerSlot(ROLLOUT_ROLE, 2, "small", "CPU-SMALL", request.host, (5, 6), tp=2)
        return Joined((slot,), [server.address], router.add_server)

    elastic._join, elastic._joins_file = join, str(joins)
    elastic.start()
    assert not joins.exists() and len(list(tmp_path.glob(f"{JOIN_FILE}.before-*"))) == 1
    assert append_request(joins, "small", "small-1") == 0
    wait(lambda: len(elastic.states) == 3, 5)
    assert [(r.host, busy) for r, busy in asked] == [("small-1", {"big-2", "small-0"})]
    assert elastic.states == [UP, UP, JOINING] and router.shares[2] == 0
    # It joins the relay route at the next update, and the routing once it holds the committed version.
    rerouted = []
    elastic._reroute = rerouted.append
    elastic.before_update()
    assert rerouted == [[True, True, True]]
    elastic.on_version(1)  # it still serves "default"
    assert elastic.states[2] == JOINING and router.shares[2] == 0 and changes == []
    started[0].weight_version = "1"
    elastic.on_version(1)
    assert elastic.states == [UP, UP, UP] and all(share > 0 for share in router.shares)
    (gain,) = changes
    assert gain.kind == "gained" and gain.hosts == ["small-1/2"] and "join request 0" in gain.reason
    assert gain.shares == pytest.approx(
        dict(zip(["big-2/0", "small-0/1", "small-1/2"], router.shares, strict=True))
    )
    assert gain.shares["small-0/1"] == pytest.approx(gain.shares["small-1/2"])  # one shape, one share
    assert gain.tokens_per_s_after > gain.tokens_per_s_before
    metrics = elastic.step_metrics()
    assert metrics["hex/elastic/joined"] == 1 and metrics["hex/elastic/live_servers"] == 3
    # A machine that does not come is recorded as lost; the run goes on.
    append_request(joins, "small", "small-9")
    wait(lambda: len(changes) == 2, 5)
    assert changes[1].kind == "lost" and "join request 1 failed: no such machine" in changes[1].reason
    assert elastic.summary()["joined"] == 1 and len(elastic.states) == 3


def test_a_server_lost_during_an_update_leaves_its_commit_set(rig, servers):
    from areal_hex_plugin.transport.controller_adapter import HexPPOActorController, TransportSettings
    from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
    from areal_hex_plugin.transport.wire import TransportError

    elastic = rig[0]
    endpoints = [Endpoint("127.0.0.1", 7001), Endpoint("127.0.0.1", 7002)]
    actor = HexPPOActorController.__new__(HexPPOActorController)
    actor._hex_route = Route(
        [PoolRoute("big", endpoints[:1], 1.0, 1.0), PoolRoute("small", endpoints[1:], 1.0, 1.0)]
    )
    actor.hex_settings = TransportSettings(min_committed_fraction=1.0)
    actor.hex_ranks = {str(e): rank for rank, e in enumerate(endpoints)}
    actor.hex_lost_among = elastic.lost_among
    report = {
        "version": 3, "bytes": 1e6, "seconds": 0.5, "resent_buckets": 0, "reroutes": 0, "part_bytes": {"0": 1},
        "digest": "0" * 64, "update": "1" * 64, "committed": [str(endpoints[0])],
        "failed": {str(endpoints[1]): "commit failed: the server did not load"},
    }  # fmt: skip
    with pytest.raises(TransportError, match="only 1 of 2 replicas committed"):
        actor._check(report)  # the small server still answers: its failure fails the version
    assert elastic.states == [UP, UP]
    servers[1].close()
    actor._check(report)  # it does not any more: lost, out of the commit set
    assert elastic.counts["lost"] == 1 and elastic.states[1] != UP and actor.hex_last_report is report


def test_a_server_lost_and_relaunched_at_once_is_still_counted_lost(rig, servers):
    """The loss found by a failed commit counts as a loss even when the relaunch it starts has already brought
    the rank back as joining (a race CI hit: the count read the state after the relaunch thread moved it)."""
    elastic = rig[0]
    mark_down = elastic.mark_down

    def mark_down_then_relaunched(rank: int, reason: str):
        marked = mark_down(rank, reason)
        deadline = time.monotonic() + 10
        while (
            elastic.states[rank] == DOWN and time.monotonic() < deadline
        ):  # the relaunch thread wins the race
            time.sleep(0.01)
        return marked

    elastic.mark_down = mark_down_then_relaunched
    servers[1].close()
    assert elastic.lost_among([1]) == 1
    assert elastic.states[1] == JOINING and elastic.counts["lost"] == 1


class _HttpWorkers:
    """Upstream's scheduler as the controller uses it for a control call: each worker's engine makes the call on
    its server over HTTP (as upstream's RemoteSGLangEngine does), an unanswered call raising."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    async def async_call_engine(self, worker_id: str, method: str, engine_name: str, **kwargs):
        import requests

        path = {"pause_generation": "/pause_generation", "continue_generation": "/continue_generation"}[
            method
        ]
        answer = await asyncio.to_thread(
            requests.post, f"http://{self.addresses[int(worker_id)]}{path}", timeout=2
        )
        answer.raise_for_status()


def _controller(elastic, addresses: list[str]):
    from types import SimpleNamespace

    from areal_hex_plugin.areal.engines import HexRolloutController

    controller = HexRolloutController.__new__(HexRolloutController)
    controller.hex_elastic = elastic
    controller.scheduler = _HttpWorkers(addresses)
    controller.workers = [SimpleNamespace(id=str(rank)) for rank in range(len(addresses))]
    return controller


def test_a_control_call_goes_on_without_a_server_lost_before_its_watcher_saw_it(rig, servers):
    """The small server dies between two health rounds, just before the trainer pauses generation for an update:
    its pause fails, the server is confirmed lost there and then, and the pause holds on the others (a failed
    pause on training rank 0 left the other ranks waiting at their barrier: the run hung)."""
    elastic = rig[0]
    controller = _controller(elastic, [s.address for s in servers])
    servers[1].close()
    assert elastic.states == [UP, UP]  # not yet seen by the watcher
    asyncio.run(
        controller._generic_collective_rpc_async(
            "pause_generation", controller.workers, lambda rank: f"e{rank}"
        )
    )
    assert servers[0].events == ["pause"]
    assert elastic.states[1] != UP and elastic.counts["lost"] == 1  # lost (or relaunched: joining)


def test_a_control_call_that_fails_on_a_live_server_fails(rig, servers):
    """A failure on a server that still answers its health probe is not a loss: the call raises."""
    elastic = rig[0]
    controller = _controller(elastic, [s.address for s in servers])
    servers[1].app.view_functions["pause"] = lambda: ("injected", 500)
    with pytest.raises(Exception, match="500"):
        asyncio.run(
            controller._generic_collective_rpc_async(
                "pause_generation", controller.workers, lambda r: f"e{r}"
            )
        )
    assert elastic.states == [UP, UP] and elastic.counts["lost"] == 0
