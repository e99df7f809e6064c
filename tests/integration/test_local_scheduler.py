"""HexLocalScheduler starting REAL upstream RPC workers: each role's workers get their planned pool and GPUs."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.cli_args import SchedulingSpec  # noqa: E402
from areal.api.scheduler_api import Job  # noqa: E402
from areal.infra.scheduler.exceptions import WorkerCreationError  # noqa: E402

from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler  # noqa: E402
from areal_hex_plugin.areal.worker_slots import node_local, placement_from_plan  # noqa: E402
from tests.integration.plans import session_of, two_type_plan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROBE = "tests.integration.probe_engine.PoolProbe"


def _spec(gpu: int) -> SchedulingSpec:
    return SchedulingSpec(
        cpu=1,
        gpu=gpu,
        mem=1,
        port_count=1,
        cmd="python -m areal.infra.rpc.rpc_server",
        env_vars={"PYTHONPATH": str(REPO)},
    )


def _scheduler(tmp_path: Path) -> HexLocalScheduler:
    plan = two_type_plan(servers_per_machine=1)
    (tmp_path / "name_resolve").mkdir()
    return HexLocalScheduler(
        node_local(placement_from_plan(plan), plan),
        log_dir=str(tmp_path / "logs"),
        startup_timeout=180,
        experiment_name="hex-test",
        trial_name="local",
        fileroot=str(tmp_path),
        nfs_record_root=str(tmp_path / "name_resolve"),
    )


@pytest.mark.integration
@pytest.mark.slow
def test_each_role_lands_on_its_pool_gpus(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    try:
        actor_ids = scheduler.create_workers(Job(role="actor", replicas=2, tasks=[_spec(1)]))
        rollout_ids = scheduler.create_workers(Job(role="rollout", replicas=3, tasks=[_spec(1)]))
        scheduler.get_workers("actor", timeout=180)
        scheduler.get_workers("rollout", timeout=180)

        async def report(worker_id: str) -> dict:
            await scheduler.create_engine(worker_id, PROBE)
            return await scheduler.async_call_engine(worker_id, "whereami")

        async def all_reports() -> list[dict]:
            return await asyncio.gather(*(report(w) for w in actor_ids + rollout_ids))

        reports = dict(zip(actor_ids + rollout_ids, asyncio.run(all_reports()), strict=True))
        pids = {r["pid"] for r in reports.values()}
        assert len(pids) == 5  # five real processes
        got = {w: (r["HEX_POOL"], r["HEX_GPU_TYPE"], r["HEX_GPU_IDS"]) for w, r in reports.items()}
        assert got == {
            "actor/0": ("big", "H100", "0"),
            "actor/1": ("big", "H100", "1"),
            "rollout/0": ("big", "H100", "2"),
            "rollout/1": ("small", "L40S", "4"),
            "rollout/2": ("small", "L40S", "6"),
        }
    finally:
        scheduler.delete_workers()


@pytest.mark.integration
def test_replica_count_not_in_the_plan_starts_nothing(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path)
    with pytest.raises(WorkerCreationError, match="plan places 3"):
        scheduler.create_workers(Job(role="rollout", replicas=4, tasks=[_spec(1)]))
    with pytest.raises(WorkerCreationError, match="asks for 2 GPUs but the plan gives it 1"):
        scheduler.create_workers(Job(role="actor", replicas=2, tasks=[_spec(2)]))
    assert scheduler._workers == {}


@pytest.mark.integration
def test_factory_reads_nvidia_smi_and_can_share_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_hex_plugin.areal.config import HexGRPOConfig
    from areal_hex_plugin.areal.launch import scheduler_factory
    from areal_hex_plugin.areal.worker_slots import SHARE_GPUS_ENV
    from areal_hex_plugin.errors import HexError

    fake = tmp_path / "nvidia-smi"  # one H100 and one L40S, as nvidia-smi prints them
    fake.write_text(
        "#!/bin/sh\necho '0, NVIDIA H100 80GB HBM3, 81559 MiB'\necho '1, NVIDIA L40S, 46068 MiB'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    config = HexGRPOConfig(experiment_name="hex-test", trial_name="factory")
    config.scheduler.type = "hex_local"
    config.cluster.fileroot = str(tmp_path)
    config.cluster.name_resolve.nfs_record_root = str(tmp_path)
    plan = two_type_plan()
    with pytest.raises(HexError, match="needs 4 H100 GPUs but this machine has 1"):
        scheduler_factory(session_of(config, plan))
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    scheduler = scheduler_factory(session_of(config, plan))()
    ids = {i for slots in scheduler.placement.slots.values() for s in slots for i in s.gpu_ids}
    assert ids == {0, 1} and scheduler.gpu_devices == [0, 1]


@pytest.mark.integration
def test_a_worker_is_found_while_another_thread_adds_a_role(tmp_path: Path) -> None:
    """A join or live re-layout adds a scheduler role from its own thread while the trainer's RPCs look their
    workers up (upstream iterates the role dict itself: "dictionary changed size during iteration")."""
    scheduler = _scheduler(tmp_path)

    class AddsARoleWhenRead:
        @property
        def worker(self):
            scheduler._workers["rollout-join-1"] = []  # the other thread's create_workers, mid-lookup
            return types.SimpleNamespace(id="actor/0")

    scheduler._workers = {"actor": [AddsARoleWhenRead()], "rollout": []}
    try:
        assert scheduler._find_worker_by_id("rollout/9") is None
        assert "rollout-join-1" in scheduler._workers
    finally:
        scheduler._workers = {}  # no process behind them to delete at exit
