"""``HexRayScheduler``: upstream's (1.0.4) RayScheduler with every planned worker's bundle tied to its pool.

Each bundle carries a small share of a per-node resource that only the pool's nodes have: the pool's own
``hex_pool:<name>`` resource when the nodes were started with it, else Ray's automatic
``accelerator_type:<X>`` for the pool's GPU type. Shim for 1.0.4's placement strategies: the strategies below
subclass upstream's and only change how bundles and actor resources are built (1.0.4 decides GPU vs CPU from
the *local* CUDA, which is wrong for a CPU head node; here the device is the cluster's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal.api.cli_args import SchedulingSpec
from areal.api.scheduler_api import Job
from areal.infra.scheduler.ray import RayScheduler
from areal.infra.utils.ray import create_resource_spec
from areal.infra.utils.ray_placement_group import (
    DeferredDeviceRayPlacementStrategy,
    RayPlacementStrategy,
    SeparatedRayPlacementStrategy,
)

from areal_hex_plugin.areal.schedulers.common import PlannedRollout, announced_session, planned_job
from areal_hex_plugin.areal.session import HexSession
from areal_hex_plugin.areal.worker_slots import Placement, check_plan_fits_inventory
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.inventory import canonical_gpu_type, group_pools, machines_from_ray_nodes
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.specs.catalog import build_catalog

# Per bundle; a node holds 1.0 of its pool resource, so up to 1000 workers fit on one node.
POOL_RESOURCE_SHARE = 0.001
POOL_RESOURCE_PREFIX = "hex_pool:"


def _bundle(cpu: int, mem_gb: int, gpus: int, pool_resource: str, device: str) -> dict[str, float]:
    bundle = {"CPU": float(cpu), "memory": float(mem_gb * 1024**3), pool_resource: POOL_RESOURCE_SHARE}
    if gpus > 0:
        bundle[device] = float(gpus)
    return bundle


def _pool_of(spec: SchedulingSpec, pool_resources: dict[str, str]) -> str:
    pool = spec.env_vars.get("HEX_POOL", "")
    if pool not in pool_resources:
        raise HexError("scheduler", f"worker spec names pool {pool!r}, which has no Ray resource", "re-plan")
    return pool_resources[pool]


@dataclass
class PoolSeparatedStrategy(SeparatedRayPlacementStrategy):
    """One placement group per worker, its bundle on a node of the worker's pool."""

    pool_resources: dict[str, str] = field(default_factory=dict)
    device: str = "GPU"

    def _create_bundles(self, spec: SchedulingSpec, n_gpus_per_node: int) -> list[dict]:
        return [_bundle(spec.cpu, spec.mem, spec.gpu, _pool_of(spec, self.pool_resources), self.device)]

    def _get_resource_spec(self, spec: SchedulingSpec) -> dict:
        return create_resource_spec(self.device, spec.cpu, spec.gpu, spec.mem * 1024**3)


@dataclass
class PoolDeferredStrategy(DeferredDeviceRayPlacementStrategy):
    """Upstream's deferred strategy (the server takes the GPUs) with bundles split by the pool's node size."""

    pool_resources: dict[str, str] = field(default_factory=dict)
    gpus_per_node: dict[str, int] = field(default_factory=dict)
    device: str = "GPU"

    def _create_bundles(self, spec: SchedulingSpec, n_gpus_per_node: int) -> list[dict]:
        resource = _pool_of(spec, self.pool_resources)
        per_node = self.gpus_per_node.get(spec.env_vars["HEX_POOL"], n_gpus_per_node)
        sizes = [per_node] * (spec.gpu // per_node) + ([spec.gpu % per_node] if spec.gpu % per_node else [])
        # CPU and memory go with the first bundle (the server's head process).
        return [
            _bundle(spec.cpu if i == 0 else 0, spec.mem if i == 0 else 0, n, resource, self.device)
            for i, n in enumerate(sizes or [0])
        ]

    def _get_resource_spec(self, spec: SchedulingSpec) -> dict:
        return create_resource_spec(self.device, 0, 0, 0)


def pool_resources_from_nodes(plan: HexPlan, nodes: list[dict]) -> dict[str, str]:
    """Pool -> the Ray resource that pins a bundle to that pool's nodes, checked against the live nodes."""
    catalog = build_catalog()
    check_plan_fits_inventory(plan, group_pools(machines_from_ray_nodes(nodes), catalog), "ray")
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    by_type: dict[str, str] = {}
    for resources in alive:
        for key in resources:
            if key.startswith("accelerator_type:"):
                by_type.setdefault(canonical_gpu_type(key.split(":", 1)[1], catalog), key)
    out = {}
    for machine in plan.machines:
        own = POOL_RESOURCE_PREFIX + machine.pool
        out[machine.pool] = own if any(own in r for r in alive) else by_type.get(machine.gpu_type, own)
    return out


class HexRayScheduler(PlannedRollout, RayScheduler):
    """Puts each planned role's workers only on nodes of their pools; other roles keep upstream's behaviour.
    ``HexRayScheduler(exp_config=config)`` takes the run's session for ``config`` (:func:`session_for`)."""

    def __init__(
        self,
        placement: Placement | None = None,
        pool_resources: dict[str, str] | None = None,
        gpus_per_node: dict[str, int] | None = None,
        **kwargs,
    ) -> None:
        if placement is None:  # built from exp_config alone (upstream's way): set up here
            planned = self.setup(announced_session(kwargs.get("exp_config"), "hex_ray"))
            placement, pool_resources = planned["placement"], planned["pool_resources"]
            gpus_per_node = gpus_per_node or planned["gpus_per_node"]
        exp_config = kwargs.get("exp_config")
        if exp_config is not None:
            # Upstream waits a fixed 30 s for each Ray worker to answer, less than importing areal takes on a busy
            # machine; wait as long as the recipe lets a rollout server start (rollout.setup_timeout).
            kwargs.setdefault("startup_timeout", max(30.0, exp_config.rollout.setup_timeout))
        super().__init__(**kwargs)
        self.placement = placement
        self.pool_resources = pool_resources or {}
        self.gpus_per_node = gpus_per_node or {}

    @staticmethod
    def setup(session: HexSession) -> dict:
        """The plan's placement and the Ray resource of each pool, checked against the live Ray nodes (Ray is
        joined at ``RAY_ADDRESS``, default ``auto``, and stays joined for the scheduler)."""
        import importlib.util
        import os

        import ray

        if importlib.util.find_spec("areal.infra.utils.ray_placement_group") is None:
            # areal 2.x rewrote its Ray scheduler (HTTP workers, _build_node_plan); the shim targets 1.0.4.
            raise HexError(
                "scheduler.type",
                "hex_ray supports the Ray scheduler of areal 1.0.4 only",
                "install areal==1.0.4, or use hex_local / hex_slurm",
            )
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto")
            try:
                ray.init(address=address, logging_level="ERROR")
            except (ConnectionError, RuntimeError) as exc:
                raise HexError(
                    "scheduler.type", f"hex_ray found no Ray cluster at {address}: {exc}", "start Ray first"
                ) from None
        nodes = list(session.live_inventory("ray").ray_nodes)
        return {
            "placement": session.placement,
            "pool_resources": pool_resources_from_nodes(session.plan, nodes),
            "gpus_per_node": {p.name: p.gpus_per_machine for p in session.config.hex.cluster.pools},
        }

    def create_workers(self, job: Job, *args, **kwargs) -> list[str]:
        return super().create_workers(planned_job(self.placement, job)[0], *args, **kwargs)

    def _get_placement_strategy(self, schedulings: list[SchedulingSpec]) -> RayPlacementStrategy:
        if not all("HEX_POOL" in s.env_vars for s in schedulings):
            return super()._get_placement_strategy(schedulings)
        if schedulings[0].ray_placement_strategy == "deferred":
            return PoolDeferredStrategy(pool_resources=self.pool_resources, gpus_per_node=self.gpus_per_node)
        # "shared" packs a whole role into one group, which cannot span pools: one group per worker instead.
        return PoolSeparatedStrategy(pool_resources=self.pool_resources)
