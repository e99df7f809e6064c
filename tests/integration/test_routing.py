"""Share-weighted routing across unequal rollout servers, and per-GPU-type SGLang flags."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from areal_hex_plugin.areal.routing import ShareRouter
from areal_hex_plugin.areal.sglang_flags import server_args_for

SHARES = [0.4, 0.3, 0.2, 0.1]


def test_shares_policy_follows_the_plan_over_many_requests() -> None:
    router = ShareRouter(SHARES)
    counts = Counter(router.choose() for _ in range(10_000))
    for i, share in enumerate(SHARES):
        assert counts[i] / 10_000 == pytest.approx(share, abs=0.001)


def test_least_outstanding_sends_more_to_faster_servers() -> None:
    # Each server drains its own queue at a rate proportional to its share; 32 requests stay in flight.
    router = ShareRouter(SHARES, policy="least_outstanding")
    rng = random.Random(0)
    counts = Counter(router.choose() for _ in range(32))
    for _ in range(20_000):
        busy = [i for i, n in enumerate(router.outstanding) if n > 0]
        finished = rng.choices(busy, weights=[SHARES[i] for i in busy])[0]
        router.release(finished)
        counts[router.choose()] += 1
    total = sum(counts.values())
    for i, share in enumerate(SHARES):
        assert counts[i] / total == pytest.approx(share, rel=0.05)
    assert sum(router.take_completed()) == 20_000 and sum(router.take_completed()) == 0
    assert sum(router.take_failed()) == 0


def test_release_counts_failures_and_refuses_a_second_release() -> None:
    router = ShareRouter(SHARES)
    first, second = router.choose(), router.choose()
    router.release(first)
    router.release(second, completed=False)
    assert router.outstanding == [0] * 4
    assert sum(router.take_completed()) == 1 and sum(router.take_failed()) == 1
    with pytest.raises(RuntimeError, match="no request in flight"):
        router.release(first)


def test_bad_router_input() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        ShareRouter([1.0], policy="random")
    for shares in ([0.0, 0.0], [-1.0, 2.0], []):
        with pytest.raises(ValueError, match="positive"):
            ShareRouter(shares)


@pytest.mark.parametrize(
    ("gpu_type", "hbm", "attention", "mem"),
    [("H100", 80, "fa3", 0.88), ("A100-80GB", 80, "flashinfer", 0.88), ("L40S", 48, "flashinfer", 0.85),
     ("RTX4090", 24, "flashinfer", 0.8)],
)  # fmt: skip
def test_server_flags_per_gpu_type(gpu_type: str, hbm: float, attention: str, mem: float) -> None:
    args = server_args_for(
        gpu_type, hbm, {"attention_backend": "fa3", "mem_fraction_static": 0.88, "tp_size": 1}
    )
    assert (args["attention_backend"], args["mem_fraction_static"], args["tp_size"]) == (attention, mem, 1)


def test_unknown_memory_keeps_the_recipe_fraction() -> None:
    args = server_args_for("MI300X", None, {"attention_backend": "fa3", "mem_fraction_static": 0.93})
    assert args == {"attention_backend": "flashinfer", "mem_fraction_static": 0.93}


def _controller(tmp_path: Path, routing: str = "shares"):
    pytest.importorskip("areal")
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.scheduler_api import Worker

    from areal_hex_plugin.areal.engines import HexRemoteSGLangEngine, HexRolloutController
    from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler
    from areal_hex_plugin.areal.worker_slots import node_local, placement_from_plan
    from tests.integration.plans import two_type_plan

    plan = two_type_plan()
    (tmp_path / "nr").mkdir(parents=True)
    placement = replace(placement_from_plan(plan), routing=routing)
    scheduler = HexLocalScheduler(
        node_local(placement, plan),
        log_dir=str(tmp_path),
        experiment_name="hex-test",
        trial_name="routing",
        fileroot=str(tmp_path),
        nfs_record_root=str(tmp_path / "nr"),
    )
    controller = HexRemoteSGLangEngine.as_controller(
        InferenceEngineConfig(backend="sglang:d6p1t1"), scheduler
    )
    assert isinstance(controller, HexRolloutController)
    controller._worker_role = "rollout"
    controller.workers = [Worker(id=f"rollout/{i}", ip="127.0.0.1") for i in range(6)]
    return controller


@pytest.mark.integration
def test_rollout_controller_routes_by_plan_shares(tmp_path: Path) -> None:
    controller = _controller(tmp_path)
    picks = Counter(controller._choose_worker()[0].id for _ in range(6000))
    # Two H100 servers share half the samples, four L40S servers the other half.
    assert picks["rollout/0"] / 6000 == pytest.approx(0.25, abs=0.01)
    assert picks["rollout/5"] / 6000 == pytest.approx(0.125, abs=0.01)


@pytest.mark.integration
def test_least_outstanding_routing_from_the_recipe_avoids_a_stuck_server(tmp_path: Path) -> None:
    controller = _controller(tmp_path, routing="least_outstanding")
    stuck = controller._choose_worker()[1]  # never released: a server that stopped answering
    picks = []
    for _ in range(600):
        rank = controller._choose_worker()[1]
        controller._router().release(rank)
        picks.append(rank)
    assert stuck not in picks
    # Under "shares" the same server keeps its share whatever it has in flight.
    shares = _controller(tmp_path / "shares", routing="shares")
    shares._choose_worker()
    assert 0 in [shares._choose_worker()[1] for _ in range(600)]


@pytest.mark.integration
def test_failed_rollouts_release_their_server(tmp_path: Path) -> None:
    import asyncio

    from areal.infra.controller.rollout_controller import _RemoteRolloutTaskInput
    from areal.infra.staleness_manager import StalenessManager

    controller = _controller(tmp_path)
    controller._staleness_manager = StalenessManager(controller, 16, 4, 1)
    tasks = [_RemoteRolloutTaskInput(task_id=i, data={}, workflow=None, workflow_kwargs={}, should_accept_fn=None)
             for i in range(12)]  # fmt: skip

    async def run_all() -> list:
        # No worker process exists, so upstream's submit fails and rejects each rollout.
        return await asyncio.gather(*(controller._create_submit_callback(t)() for t in tasks))

    assert asyncio.run(run_all()) == [None] * 12
    router = controller._router()
    # Released, and counted as failures: a failed rollout produced no sample.
    assert router.outstanding == [0] * 6
    assert controller.staleness_manager.get_stats().rejected == 12
    assert controller.pool_sample_stats() == {
        "hex/rollout/big/samples": 0,
        "hex/rollout/small/samples": 0,
        "hex/rollout/big/failed": 6,
        "hex/rollout/small/failed": 6,
    }


@pytest.mark.integration
def test_failed_agenerate_calls_release_their_server(tmp_path: Path) -> None:
    import asyncio

    controller = _controller(tmp_path, routing="least_outstanding")

    async def call_all() -> list:
        # No worker process exists, so every call fails inside upstream's agenerate.
        return await asyncio.gather(*(controller.agenerate({}) for _ in range(12)), return_exceptions=True)

    assert all(isinstance(r, Exception) for r in asyncio.run(call_all()))
    router = controller._router()
    assert router.outstanding == [0] * 6
    assert sum(router.take_completed()) == 0 and sum(router.take_failed()) == 12


@pytest.mark.integration
def test_only_the_training_rollout_reports_per_pool_samples(tmp_path: Path) -> None:
    """eval-rollout routes over the same servers; its counts must not overwrite the training rollout's."""
    controller = _controller(tmp_path)
    router = controller._router()
    for _ in range(3):
        router.release(router.choose())
    assert sum(controller.pool_sample_stats().values()) == 3
    for _ in range(2):
        router.release(router.choose())
    controller._worker_role = "eval-rollout"
    assert controller.pool_sample_stats() == {}


@pytest.mark.integration
def test_evaluation_routes_like_training_over_the_servers_it_has(tmp_path: Path) -> None:
    """The eval-rollout controller takes the training shares of its own servers: a lost one gets none, one that
    joined (past its workers) is training's only; shares that leave it no server change nothing."""
    controller = _controller(tmp_path)
    controller._worker_role = "eval-rollout"
    planned = controller._router().shares
    controller.hex_route_like([0.2, 0.2, 0.0, 0.2, 0.2, 0.0, 0.2])  # server 2 lost, a seventh joined
    shares = controller._router().shares
    assert shares == pytest.approx([0.25, 0.25, 0.0, 0.25, 0.25, 0.0]) and planned[5] > 0
    picked = {controller._router().choose() for _ in range(40)}
    assert picked == {0, 1, 3, 4}
    controller.hex_route_like([0.0] * 6 + [1.0])
    assert controller._router().shares == shares


@pytest.mark.integration
def test_a_drain_counts_the_requests_evaluation_holds(tmp_path: Path) -> None:
    """A live re-layout stops a server once it holds no request: training's and evaluation's (the eval-rollout
    controller routes over the same servers; a server that joined may have none of its requests)."""
    from types import SimpleNamespace

    from areal_hex_plugin.areal.trainer import HexPPOTrainer

    training, evaluation = _controller(tmp_path / "t"), _controller(tmp_path / "e")
    evaluation._worker_role = "eval-rollout"
    picked = [training._router().choose() for _ in range(6)] + [
        evaluation._router().choose() for _ in range(6)
    ]
    trainer = SimpleNamespace(rollout=training, eval_rollout=evaluation)
    held = [HexPPOTrainer.hex_in_flight(trainer, rank) for rank in range(6)]
    assert held == [picked.count(rank) for rank in range(6)] and sum(held) == 12
    training._router().add_server()  # a server that joined, beside no eval worker yet
    assert HexPPOTrainer.hex_in_flight(trainer, 6) == 0
    trainer.eval_rollout = None
    assert [
        HexPPOTrainer.hex_in_flight(trainer, rank) for rank in range(6)
    ] == training._router().outstanding[:6]


ANSWER = "tests.integration.probe_engine.AnswerProbe"


@pytest.fixture(scope="module")
def answering(tmp_path_factory: pytest.TempPathFactory):
    """A HexRolloutController whose six servers are engines of one real upstream RPC worker (AnswerProbe)."""
    import asyncio

    from areal.api.cli_args import SchedulingSpec
    from areal.api.scheduler_api import Job
    from areal.infra.staleness_manager import StalenessManager

    from tests.conftest import REPO

    controller = _controller(tmp_path_factory.mktemp("answering"), routing="least_outstanding")
    scheduler = controller.scheduler
    spec = SchedulingSpec(
        cpu=1, gpu=0, mem=1, port_count=1, cmd="python -m areal.infra.rpc.rpc_server",
        env_vars={"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        scheduler.create_workers(Job(role="answer", replicas=1, tasks=[spec]))
        worker = scheduler.get_workers("answer", timeout=180)[0]

        async def engines() -> None:
            for rank in range(6):
                await scheduler.create_engine(worker.id, ANSWER, engine_name=f"rollout/{rank}")

        asyncio.run(engines())
        controller.workers = [worker] * 6
        controller._staleness_manager = StalenessManager(controller, 16, 4, 1)
        # Upstream's submit names a callback address; nothing calls it back here (the test resolves the future).
        controller._callback_host, controller._callback_port = "127.0.0.1", 9
        yield controller
    finally:
        scheduler.delete_workers()


def _fresh_router(controller):
    controller._hex_router = None
    return controller._router()


@pytest.mark.integration
@pytest.mark.slow
def test_agenerate_releases_every_pick(answering) -> None:
    import asyncio

    router = _fresh_router(answering)

    async def sequential() -> None:
        for i in range(12):
            request = {"fail": True} if i in (3, 7) else {}
            try:
                await answering.agenerate(request)
            except Exception:  # noqa: BLE001 - the two failing requests
                assert i in (3, 7)

    asyncio.run(sequential())
    assert router.outstanding == [0] * 6
    assert sum(router.take_completed()) == 10 and sum(router.take_failed()) == 2


@pytest.mark.integration
@pytest.mark.slow
def test_aborted_calls_release_their_server(answering) -> None:
    import asyncio
    import contextlib

    from areal.infra.controller.rollout_controller import _RemoteRolloutTaskInput

    router = _fresh_router(answering)

    async def abort(start) -> None:
        task = asyncio.ensure_future(start())
        while sum(router.outstanding) == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(abort(lambda: answering.agenerate({"sleep_s": 2.0})))
    rollout = _RemoteRolloutTaskInput(
        task_id=7, data={}, workflow=None, workflow_kwargs={}, should_accept_fn=None
    )
    asyncio.run(abort(answering._create_submit_callback(rollout)))  # no callback ever comes: aborted waiting
    assert router.outstanding == [0] * 6
    assert sum(router.take_completed()) == 0 and sum(router.take_failed()) == 2


@pytest.mark.integration
@pytest.mark.slow
def test_finished_rollout_counts_as_a_sample(answering) -> None:
    import asyncio

    from areal.infra.controller.rollout_controller import _RemoteRolloutTaskInput

    router = _fresh_router(answering)
    rollout = _RemoteRolloutTaskInput(
        task_id=8, data={}, workflow=None, workflow_kwargs={}, should_accept_fn=None
    )

    async def finish():
        task = asyncio.ensure_future(answering._create_submit_callback(rollout)())
        while 8 not in answering._pending_futures:
            await asyncio.sleep(0.01)
        answering._resolve_task_future(8)  # what upstream's callback server does when the rollout completes
        return await task

    result = asyncio.run(finish())
    assert result.task_id == 8 and result.trajectory["task_id"] == 8
    assert router.outstanding == [0] * 6
    assert sum(router.take_completed()) == 1 and sum(router.take_failed()) == 0
