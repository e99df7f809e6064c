"""Choose and build the Hex scheduler for ``scheduler.type``, after checking the plan against the live cluster.

Every check here runs before any worker starts, so a plan that does not fit stops the run with one clear
:class:`HexError` and nothing is left running.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable

from areal_hex_plugin.areal.placement import Placement, check_plan_fits_inventory, node_local
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan

HEX_SCHEDULERS = ("hex_local", "hex_ray", "hex_slurm")
# hex_local only: "1" lets planned roles share this machine's GPUs (smoke tests on a one-GPU machine).
SHARE_GPUS_ENV = "HEX_LOCAL_SHARE_GPUS"
UPSTREAM_SCHEDULERS = ("local", "ray", "slurm")


def check_scheduler_type(kind: str | None) -> None:
    if kind not in HEX_SCHEDULERS:
        raise HexError(
            "scheduler.type",
            f"unknown scheduler type {kind!r} for a hex run",
            f"use one of {', '.join(HEX_SCHEDULERS)} (or {', '.join(UPSTREAM_SCHEDULERS)} with upstream's own "
            "script, which ignores the plan)",
        )


def check_local_gpus(plan: HexPlan, machines: list, share: bool = False) -> list[int]:
    """hex_local lays every planned machine on this node: it needs the planned GPU types, and as many GPUs of
    each as planned unless ``share``. Returns this node's device ids."""
    from areal_hex_plugin.inventory import canonical_gpu_type
    from areal_hex_plugin.specs.catalog import build_catalog

    catalog = build_catalog()
    have: dict[str, int] = defaultdict(int)
    for m in machines:
        have[canonical_gpu_type(m.gpu_name, catalog)] += m.gpus
    need: dict[str, int] = defaultdict(int)
    for machine in plan.machines:
        need[machine.gpu_type] += sum(1 for g in machine.gpus if g.role != "idle")
    for gpu_type, n in sorted(need.items()):
        if n and have.get(gpu_type, 0) < (1 if share else n):
            raise HexError(
                "hex.plan_path",
                f"the plan needs {n} {gpu_type} GPUs but this machine has {have.get(gpu_type, 0)}",
                "re-plan for this machine (areal-hex inventory --from local) or use hex_ray/hex_slurm",
            )
    return list(range(sum(have.values())))


def scheduler_factory(config, plan: HexPlan, placement: Placement) -> Callable[[], object]:
    """Check the plan against the live cluster of ``scheduler.type`` and return a builder for its scheduler."""
    kind = config.scheduler.type
    check_scheduler_type(kind)
    gpus_per_node = {p.name: p.gpus_per_machine for p in config.hex.cluster.pools}
    if kind == "hex_local":
        from areal_hex_plugin.inventory import machines_from_local

        share = os.environ.get(SHARE_GPUS_ENV) == "1"
        devices = check_local_gpus(plan, machines_from_local(), share)

        def build_local():
            from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler

            return HexLocalScheduler(
                node_local(placement, plan, devices if share else None), exp_config=config
            )

        return build_local
    if kind == "hex_ray":
        import importlib.util

        import ray

        if importlib.util.find_spec("areal.infra.utils.ray_placement_group") is None:
            # areal 2.x rewrote its Ray scheduler (HTTP workers, _build_node_plan); the shim targets 1.0.4.
            raise HexError(
                "scheduler.type",
                "hex_ray supports the Ray scheduler of areal 1.0.4 only",
                "install areal==1.0.4, or use hex_local / hex_slurm",
            )

        from areal_hex_plugin.areal.schedulers.ray import pool_resources_from_nodes

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto")
            try:
                ray.init(address=address, logging_level="ERROR")
            except (ConnectionError, RuntimeError) as exc:
                raise HexError(
                    "scheduler.type", f"hex_ray found no Ray cluster at {address}: {exc}", "start Ray first"
                ) from None
        resources = pool_resources_from_nodes(plan, ray.nodes())

        def build_ray():
            from areal_hex_plugin.areal.schedulers.ray import HexRayScheduler

            return HexRayScheduler(placement, resources, gpus_per_node, exp_config=config)

        return build_ray
    from areal_hex_plugin.areal.schedulers.slurm import slurm_pools_from_sinfo
    from areal_hex_plugin.inventory import group_pools, machines_from_slurm

    machines = machines_from_slurm()
    check_plan_fits_inventory(plan, group_pools(machines), "slurm")
    pools = slurm_pools_from_sinfo(placement, machines, gpus_per_node)

    def build_slurm():
        from areal_hex_plugin.areal.schedulers.slurm import HexSlurmScheduler

        return HexSlurmScheduler(placement, pools, exp_config=config)

    return build_slurm
