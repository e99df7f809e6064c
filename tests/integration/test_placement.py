"""Plan -> worker slots, and the checks that refuse a plan before any worker starts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from areal_hex_plugin.areal.worker_slots import check_plan_fits_inventory, node_local, placement_from_plan
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.inventory import DiscoveredPool
from areal_hex_plugin.plan import ReplicaGroup, check_plan_fits
from areal_hex_plugin.specs.catalog import build_catalog
from areal_hex_plugin.specs.cluster import build_cluster
from areal_hex_plugin.specs.config import ClusterConfig, PoolConfig
from areal_hex_plugin.specs.models import BUILTIN_MODELS
from tests.integration.plans import two_type_plan


def _cluster(big_hosts=("big-0", "big-1"), small_type="L40S"):
    cfg = ClusterConfig(
        pools=[
            PoolConfig(
                name="big", gpu_type="H100", gpus_per_machine=2, hosts=list(big_hosts), price_per_gpu_hour=3
            ),
            PoolConfig(
                name="small", gpu_type=small_type, gpus_per_machine=2, machines=2, price_per_gpu_hour=1
            ),
        ]
    )
    return build_cluster(cfg, build_catalog())


def test_slots_follow_the_plan() -> None:
    placement = placement_from_plan(two_type_plan())
    actor, rollout = placement.for_role("actor"), placement.for_role("rollout")
    assert [(s.pool, s.host, s.gpu_ids) for s in actor] == [("big", "big-0", (0,)), ("big", "big-0", (1,))]
    assert [s.gpu_type for s in rollout] == ["H100"] * 2 + ["L40S"] * 4
    assert sum(s.share for s in rollout) == pytest.approx(1.0)
    assert (placement.train_dp, placement.train_tp, placement.rollout_layouts) == (2, 1, [(1, 1)])
    assert [(s.tp, s.pp, s.concurrency) for s in rollout] == [(1, 1, 64)] * 2 + [(1, 1, 32)] * 4


def test_one_node_layout_gives_distinct_device_ids() -> None:
    plan = two_type_plan()
    local = node_local(placement_from_plan(plan), plan)
    ids = [i for slots in local.slots.values() for s in slots for i in s.gpu_ids]
    assert sorted(ids) == list(range(8))


def test_shared_devices_fold_planned_gpus_onto_the_real_ones() -> None:
    plan = two_type_plan()
    local = node_local(placement_from_plan(plan), plan, devices=[0, 1])
    assert [s.gpu_ids for s in local.for_role("actor")] == [(0,), (1,)]
    assert [s.gpu_ids for s in local.for_role("rollout")] == [(0,), (1,), (0,), (1,), (0,), (1,)]


def test_local_gpu_check_counts_unless_shared() -> None:
    from areal_hex_plugin.areal.worker_slots import check_local_gpus
    from areal_hex_plugin.inventory import Machine

    live = [Machine("box", "NVIDIA H100 80GB HBM3", 1), Machine("box2", "NVIDIA L40S", 1)]
    with pytest.raises(HexError, match="needs 4 H100 GPUs but this machine has 1"):
        check_local_gpus(two_type_plan(), live)
    assert check_local_gpus(two_type_plan(), live, share=True) == [0, 1]
    with pytest.raises(HexError, match="needs 4 L40S GPUs but this machine has 0"):
        check_local_gpus(two_type_plan(), live[:1], share=True)


def test_each_replica_group_keeps_its_own_layout() -> None:
    placement = placement_from_plan(two_type_plan(big_tp=2))
    rollout = placement.for_role("rollout")
    got = [(s.pool, s.tp, s.pp, s.gpu_ids, s.concurrency) for s in rollout]
    assert got == [("big", 2, 1, (0, 1), 128)] + [("small", 1, 1, (g,), 32) for g in (0, 1, 0, 1)]
    assert placement.rollout_layouts == [(1, 1), (2, 1)]


def test_server_spread_over_machines_or_gpus_it_lacks_is_refused() -> None:
    plan = two_type_plan()
    groups = [plan.rollout.replicas[0], replace(plan.rollout.replicas[1], tp=2, count=2)]
    with pytest.raises(
        HexError, match="has 1 GPUs on \\['small-0'\\]; upstream runs each server on its tp\\*pp = 2"
    ):
        placement_from_plan(replace(plan, rollout=replace(plan.rollout, replicas=groups)))


def test_plan_fits_its_cluster() -> None:
    check_plan_fits(two_type_plan(), _cluster(), BUILTIN_MODELS["Qwen2.5-0.5B"])


@pytest.mark.parametrize(
    ("cluster_kwargs", "message"),
    [
        ({"big_hosts": ("big-0", "big-9")}, "host\\(s\\) big-1"),
        ({"small_type": "A100"}, "has A100-80GB there"),
    ],
)
def test_stale_plan_is_refused(cluster_kwargs, message) -> None:
    with pytest.raises(HexError, match=message):
        check_plan_fits(two_type_plan(), _cluster(**cluster_kwargs), BUILTIN_MODELS["Qwen2.5-0.5B"])


def test_live_inventory_missing_type_or_machines_is_refused() -> None:
    live = [
        DiscoveredPool("h100", "H100", 2, ("big-0", "big-1"), True),
        DiscoveredPool("l40s", "L40S", 2, ("n1", "n2"), True),
    ]
    check_plan_fits_inventory(two_type_plan(), live, "ray")
    with pytest.raises(HexError, match="needs L40S machines but the live ray cluster has none"):
        check_plan_fits_inventory(two_type_plan(), live[:1], "ray")
    with pytest.raises(HexError, match="uses 2 L40S machines but the live ray cluster has 1"):
        check_plan_fits_inventory(two_type_plan(), [live[0], replace(live[1], hosts=("n1",))], "ray")
    with pytest.raises(HexError, match="missing: big-1"):
        check_plan_fits_inventory(two_type_plan(), [replace(live[0], hosts=("big-0", "x")), live[1]], "ray")


def test_replica_group_count_must_match_machines() -> None:
    plan = two_type_plan()
    groups = [plan.rollout.replicas[0], ReplicaGroup("small", "L40S", 1, 1, 5, 0.5, 32, 450.0, 32)]
    with pytest.raises(HexError, match="place 6 rollout servers but the replica groups count 7"):
        placement_from_plan(replace(plan, rollout=replace(plan.rollout, replicas=groups)))


@pytest.mark.parametrize("part", ["train.stages[0]", "rollout.replicas[1]"])
def test_tp_group_larger_than_a_machine_is_refused(part) -> None:
    plan = two_type_plan()
    if part.startswith("train"):
        stages = [replace(plan.train.stages[0], tp=4)]
        plan = replace(plan, train=replace(plan.train, stages=stages))
    else:
        groups = [plan.rollout.replicas[0], replace(plan.rollout.replicas[1], tp=4)]
        plan = replace(plan, rollout=replace(plan.rollout, replicas=groups))
    with pytest.raises(HexError, match="is 4, but .* machines have 2 GPUs") as err:
        check_plan_fits(plan, _cluster(), BUILTIN_MODELS["Qwen2.5-0.5B"])
    assert err.value.field.endswith(f"{part}.tp")
