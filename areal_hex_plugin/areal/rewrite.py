"""Rewrite an upstream experiment config from a HexPlan: backends, scheduling specs and staleness settings.

Runs before upstream parses any backend string (in the driver, and again, idempotently, in
``HexPPOTrainer._init_scheduler``), so upstream builds exactly the planned layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from areal.api.alloc_mode import ModelAllocation

from areal_hex_plugin.areal.placement import Placement, placement_from_plan
from areal_hex_plugin.plan import HexPlan


@dataclass(frozen=True)
class Rewrite:
    placement: Placement
    actor_backend: str
    rollout_backend: str
    notes: tuple[str, ...]


def _train_backend(current: str, placement: Placement) -> tuple[str, list[str]]:
    kind = ModelAllocation.from_str(current).backend
    dp, tp, pp = placement.train_dp, placement.train_tp, placement.train_pp
    notes = []
    if pp > 1 and kind == "fsdp":
        # FSDP has no pipeline dimension; the plan's stages need Megatron.
        kind = "megatron"
        notes.append(f"actor: the plan pipelines training over {pp} stages, so fsdp became megatron")
    if kind == "fsdp":
        return f"fsdp:d{dp}t{tp}", notes
    return f"{kind}:d{dp}p{pp}t{tp}", notes


def apply_plan(config, plan: HexPlan) -> Rewrite:
    """Rewrite ``config`` (an upstream PPO/GRPO config) in place to follow ``plan``."""
    placement = replace(placement_from_plan(plan), routing=config.hex.routing)
    actor_backend, notes = _train_backend(config.actor.backend, placement)
    config.actor.backend = actor_backend
    for name in ("ref", "critic"):
        role_cfg = getattr(config, name, None)
        if role_cfg is not None:
            role_cfg.backend = actor_backend
    rollout_kind = ModelAllocation.from_str(config.rollout.backend).backend
    servers = len(placement.slots["rollout"])
    rollout_backend = f"{rollout_kind}:d{servers}p{placement.rollout_pp}t{placement.rollout_tp}"
    config.rollout.backend = rollout_backend
    # One GPU per train worker; the rollout controller multiplies its spec by tp*pp per server.
    for spec in (*config.actor.scheduling_spec, *config.rollout.scheduling_spec):
        spec.gpu = 1
    config.rollout.max_concurrent_rollouts = plan.staleness.max_concurrent_rollouts
    config.rollout.max_head_offpolicyness = plan.staleness.max_head_offpolicyness
    return Rewrite(placement, actor_backend, rollout_backend, tuple(notes))
