"""HexRayScheduler on a REAL local Ray cluster with two fake GPU-type pools: each role lands only on its pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from areal.api.cli_args import GRPOConfig, SchedulingSpec  # noqa: E402
from areal.api.scheduler_api import Job  # noqa: E402

from areal_hex_plugin.areal.schedulers.ray import (  # noqa: E402
    HexRayScheduler,
    PoolDeferredStrategy,
    pool_resources_from_nodes,
)
from areal_hex_plugin.areal.worker_slots import placement_from_plan  # noqa: E402
from areal_hex_plugin.errors import HexError  # noqa: E402
from tests.integration.plans import session_of, two_type_plan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROBE = "tests.integration.probe_engine.PoolProbe"


@pytest.fixture(scope="module")
def two_pool_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for gpu_type in ("H100", "H100", "L40S", "L40S"):
            cluster.add_node(num_cpus=2, num_gpus=2, resources={f"accelerator_type:{gpu_type}": 1})
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}
        )
        # Ray node id -> the GPU type that node declares.
        yield {
            n["NodeID"]: key.split(":", 1)[1]
            for n in ray.nodes()
            for key in n["Resources"]
            if key.startswith("accelerator_type:")
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def _spec(gpu: int, strategy: str = "shared") -> SchedulingSpec:
    return SchedulingSpec(cpu=1, gpu=gpu, mem=1, port_count=1, ray_placement_strategy=strategy)


@pytest.mark.integration
@pytest.mark.slow
def test_workers_land_only_on_their_pool_nodes(two_pool_cluster, tmp_path: Path) -> None:
    plan = two_type_plan(servers_per_machine=1)
    resources = pool_resources_from_nodes(plan, ray.nodes())
    assert resources == {"big": "accelerator_type:H100", "small": "accelerator_type:L40S"}
    config = GRPOConfig(experiment_name="hex-test", trial_name="ray")
    config.cluster.name_resolve.nfs_record_root = str(tmp_path / "name_resolve")
    scheduler = HexRayScheduler(placement_from_plan(plan), resources, startup_timeout=180, exp_config=config)
    try:
        actor_ids = scheduler.create_workers(Job(role="actor", replicas=2, tasks=[_spec(1)]))
        rollout_ids = scheduler.create_workers(Job(role="rollout", replicas=3, tasks=[_spec(1, "separate")]))

        async def report(worker_id: str) -> dict:
            await scheduler.create_engine(worker_id, PROBE)
            return await scheduler.async_call_engine(worker_id, "whereami")

        async def all_reports() -> list[dict]:
            return await asyncio.gather(*(report(w) for w in actor_ids + rollout_ids))

        reports = dict(zip(actor_ids + rollout_ids, asyncio.run(all_reports()), strict=True))
        landed = {w: two_pool_cluster[r["ray_node_id"]] for w, r in reports.items()}
        assert landed == {
            **{w: "H100" for w in actor_ids},
            rollout_ids[0]: "H100",
            **{w: "L40S" for w in rollout_ids[1:]},
        }
        assert {reports[w]["HEX_POOL"] for w in rollout_ids[1:]} == {"small"}
    finally:
        scheduler.delete_workers()


@pytest.mark.integration
def test_plan_needing_a_type_the_cluster_lacks_is_refused(two_pool_cluster) -> None:
    nodes = [n for n in ray.nodes() if "accelerator_type:L40S" not in n["Resources"]]
    with pytest.raises(HexError, match="needs L40S machines but the live ray cluster has none"):
        pool_resources_from_nodes(two_type_plan(), nodes)


def test_deferred_bundles_split_by_the_pool_node_size() -> None:
    strategy = PoolDeferredStrategy(pool_resources={"big": "accelerator_type:H100"}, gpus_per_node={"big": 8})
    spec = SchedulingSpec(cpu=4, gpu=12, mem=2, env_vars={"HEX_POOL": "big"})
    bundles = strategy._create_bundles(spec, n_gpus_per_node=2)
    assert [b["GPU"] for b in bundles] == [8.0, 4.0]
    assert [b["CPU"] for b in bundles] == [4.0, 0.0]
    assert all(b["accelerator_type:H100"] > 0 for b in bundles)


def _hex_config(tmp_path: Path, scheduler_type: str):
    from areal_hex_plugin.areal.config import HexGRPOConfig
    from areal_hex_plugin.specs.config import PoolConfig

    config = HexGRPOConfig(experiment_name="hex-test", trial_name="factory")
    config.scheduler.type = scheduler_type
    config.cluster.fileroot = str(tmp_path)
    config.cluster.name_resolve.nfs_record_root = str(tmp_path)
    config.hex.cluster.pools = [
        PoolConfig(name="big", gpu_type="H100", gpus_per_machine=2, machines=2, price_per_gpu_hour=3.0),
        PoolConfig(name="small", gpu_type="L40S", gpus_per_machine=2, machines=2, price_per_gpu_hour=1.0),
    ]
    return config


@pytest.mark.integration
def test_factory_checks_the_live_ray_cluster_then_builds(two_pool_cluster, tmp_path: Path) -> None:
    from areal_hex_plugin.areal.launch import scheduler_factory

    plan = two_type_plan()
    build = scheduler_factory(session_of(_hex_config(tmp_path, "hex_ray"), plan))
    scheduler = build()
    assert isinstance(scheduler, HexRayScheduler)
    assert scheduler.pool_resources == {"big": "accelerator_type:H100", "small": "accelerator_type:L40S"}
    assert scheduler.gpus_per_node == {"big": 2, "small": 2}
    # Workers get as long to start as the recipe gives a rollout server, not upstream's fixed 30 s.
    assert scheduler.startup_timeout == 300.0
