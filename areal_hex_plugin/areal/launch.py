"""Choose and build the Hex scheduler for ``scheduler.type``, after checking the plan against the live cluster.

Every check here runs before any worker starts, so a plan that does not fit stops the run with one clear
:class:`HexError` and nothing is left running.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from areal_hex_plugin.areal.placement import Placement, check_plan_fits_inventory, node_local
from areal_hex_plugin.areal.plugin import SCHEDULERS, load, register
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan

# hex_local only: "1" lets planned roles share this machine's GPUs (smoke tests on a one-GPU machine).
SHARE_GPUS_ENV = "HEX_LOCAL_SHARE_GPUS"
UPSTREAM_SCHEDULERS = ("local", "ray", "slurm")


def check_scheduler_type(kind: str | None) -> None:
    """``kind`` must be a scheduler :func:`register` installed (``hex_local``, ``hex_ray``, ``hex_slurm``)."""
    register()
    if kind not in SCHEDULERS:
        raise HexError(
            "scheduler.type",
            f"unknown scheduler type {kind!r} for a hex run",
            f"use one of {', '.join(SCHEDULERS)} (or {', '.join(UPSTREAM_SCHEDULERS)} with upstream's own "
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


def scheduler_kwargs(kind: str, config, plan: HexPlan, placement: Placement) -> dict[str, Any]:
    """Check the plan against the live cluster of ``kind`` and return the Hex scheduler's own arguments."""
    gpus_per_node = {p.name: p.gpus_per_machine for p in config.hex.cluster.pools}
    if kind == "hex_local":
        from areal_hex_plugin.inventory import machines_from_local

        share = os.environ.get(SHARE_GPUS_ENV) == "1"
        devices = check_local_gpus(plan, machines_from_local(), share)
        return {"placement": node_local(placement, plan, devices if share else None)}
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
        return {"placement": placement, "pool_resources": resources, "gpus_per_node": gpus_per_node}
    from areal_hex_plugin.areal.schedulers.slurm import check_slurm_placement, slurm_pools_from_sinfo
    from areal_hex_plugin.inventory import group_pools, machines_from_slurm

    check_slurm_placement(placement)
    machines = machines_from_slurm()
    check_plan_fits_inventory(plan, group_pools(machines), "slurm")
    return {"placement": placement, "pools": slurm_pools_from_sinfo(placement, machines, gpus_per_node)}


def scheduler_factory(config, plan: HexPlan, placement: Placement) -> Callable[[], object]:
    """Check the plan against the live cluster of ``scheduler.type`` and return a builder for its scheduler
    (the class :func:`register` installed under that name)."""
    kind = config.scheduler.type
    check_scheduler_type(kind)
    kwargs = scheduler_kwargs(kind, config, plan, placement)
    return functools.partial(load(SCHEDULERS[kind]), exp_config=config, **kwargs)


def from_exp_config(kind: str, exp_config) -> dict[str, Any]:
    """What a Hex scheduler built from ``exp_config`` alone needs: the plan for its ``hex:`` section
    (``hex.plan_path``, or solved now), applied to the config, and checked against the live cluster."""
    if exp_config is None or not hasattr(exp_config, "hex"):
        raise HexError(
            "scheduler",
            f"{kind} needs the experiment config with its hex: section (exp_config=...), or a placement",
            "load the recipe with load_expr_config(argv, HexGRPOConfig) and pass exp_config=config",
        )
    from areal_hex_plugin.areal.planning import plan_for
    from areal_hex_plugin.areal.rewrite import apply_plan

    plan, _ = plan_for(exp_config)
    return scheduler_kwargs(kind, exp_config, plan, apply_plan(exp_config, plan).placement)
