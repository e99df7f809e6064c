"""Rewrite an upstream experiment config from a HexPlan: backends, scheduling specs and staleness settings.

Runs before upstream parses any backend string (in the driver, and again, idempotently, in
``HexPPOTrainer._init_scheduler``), so upstream builds exactly the planned layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from areal.api.alloc_mode import ModelAllocation

from areal_hex_plugin.areal.sglang_flags import server_flags
from areal_hex_plugin.areal.worker_slots import (
    ROLLOUT_ROLE,
    TRAIN_ROLE,
    Placement,
    check_plan_runs,
    placement_from_plan,
)
from areal_hex_plugin.errors import UpstreamLimit
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.caps import RuntimeCaps, backend_kind, caps_for
from areal_hex_plugin.specs.catalog import build_catalog


@dataclass(frozen=True)
class Rewrite:
    placement: Placement
    actor_backend: str
    rollout_backend: str
    notes: tuple[str, ...]


def runtime_caps(config) -> RuntimeCaps:
    """What upstream can run with this config's actor backend, ``hex.transport`` and weight-update mode."""
    rollout = ModelAllocation.from_str(config.rollout.backend).backend
    if rollout != "sglang":
        raise UpstreamLimit(
            "rollout.backend",
            f"is {rollout}; the plugin starts SGLang servers (per-server layouts, flags and weight receivers)",
            "use rollout.backend=sglang:d1 (the plan sets the numbers)",
        )
    kind = backend_kind(config.actor.backend, "actor.backend")
    return caps_for(kind, config.hex.transport, config.actor.weight_update_mode, config.scheduler.type)


def _train_backend(current: str, placement: Placement) -> str:
    kind = ModelAllocation.from_str(current).backend
    dp, tp, pp = placement.train_dp, placement.train_tp, placement.train_pp
    if kind == "fsdp":
        return f"fsdp:d{dp}t{tp}"
    return f"{kind}:d{dp}p{pp}t{tp}"


def _with_server_flags(placement: Placement, config) -> Placement:
    """Each rollout slot with the flags its server overrides in upstream's ``server_args``."""
    slots = flagged(placement.slots[ROLLOUT_ROLE], config)
    return replace(placement, slots={**placement.slots, ROLLOUT_ROLE: slots})


def flagged(slots, config) -> tuple:
    """Rollout ``slots`` with the flags of their GPU type, layout and concurrency (``sglang_flags.server_flags``)."""
    catalog = build_catalog({name: asdict(figures) for name, figures in config.hex.gpu_catalog.items()})
    base = {
        "attention_backend": getattr(config.sglang, "attention_backend", None),
        "mem_fraction_static": config.sglang.mem_fraction_static,
    }
    return tuple(
        replace(
            s,
            server_flags=tuple(
                server_flags(
                    s.gpu_type, catalog.get(s.gpu_type).hbm_gb, s.tp, s.pp, s.concurrency, base
                ).items()
            ),
        )
        for s in slots
    )


def _rollout_backend(kind: str, placement: Placement) -> tuple[str, list[str]]:
    """Upstream's rollout backend string: the server count, and the one layout when all servers share it."""
    servers = len(placement.slots[ROLLOUT_ROLE])
    layouts = placement.rollout_layouts
    if len(layouts) == 1:
        tp, pp = layouts[0]
        return f"{kind}:d{servers}p{pp}t{tp}", []
    shown = ", ".join(f"tp{tp} pp{pp}" for tp, pp in layouts)
    return f"{kind}:d{servers}p1t1", [
        f"rollout: the servers run {len(layouts)} layouts ({shown}); upstream's backend string holds one, so it "
        f"names the {servers} servers and HexRolloutController starts each with its replica group's tp/pp"
    ]


def apply_plan(config, plan: HexPlan) -> Rewrite:
    """Rewrite ``config`` (an upstream PPO/GRPO config) in place to follow ``plan``."""
    check_plan_runs(plan, runtime_caps(config))
    placement = _with_server_flags(replace(placement_from_plan(plan), routing=config.hex.routing), config)
    notes: list[str] = []
    actor_backend = _train_backend(config.actor.backend, placement)
    if actor_backend != config.actor.backend:
        gpus = len(placement.slots[TRAIN_ROLE])
        notes.append(
            f"actor.backend: {config.actor.backend} -> {actor_backend}: the plan trains on {gpus} GPUs as "
            f"dp{placement.train_dp} tp{placement.train_tp} pp{placement.train_pp} (ref and critic follow it)"
        )
    config.actor.backend = actor_backend
    for name in ("ref", "critic"):
        role_cfg = getattr(config, name, None)
        if role_cfg is not None:
            role_cfg.backend = actor_backend
    rollout_kind = ModelAllocation.from_str(config.rollout.backend).backend
    rollout_backend, rollout_notes = _rollout_backend(rollout_kind, placement)
    if rollout_backend != config.rollout.backend:
        notes.append(
            f"rollout.backend: {config.rollout.backend} -> {rollout_backend}: the plan runs "
            f"{len(placement.slots[ROLLOUT_ROLE])} rollout servers"
        )
    notes += rollout_notes
    config.rollout.backend = rollout_backend
    # One GPU per train worker; the rollout controller multiplies its spec by tp*pp per server.
    for role, specs in (("actor", config.actor.scheduling_spec), ("rollout", config.rollout.scheduling_spec)):
        if any(spec.gpu != 1 for spec in specs):
            notes.append(f"{role}.scheduling_spec gpu -> 1: upstream scales it per worker ({role} layout)")
        for spec in specs:
            spec.gpu = 1
    notes += _staleness_notes(config, plan)
    config.rollout.max_concurrent_rollouts = plan.staleness.max_concurrent_rollouts
    config.rollout.max_head_offpolicyness = plan.staleness.max_head_offpolicyness
    return Rewrite(placement, actor_backend, rollout_backend, tuple(notes))


def uses_relay(config) -> bool:
    """Whether weights go through the relay transport (else upstream's own ``weight_update_mode`` path); both
    training backends send through it (``runtime_caps`` refused any other before)."""
    return config.hex.transport == "relay"


def _staleness_notes(config, plan: HexPlan) -> list[str]:
    """Why the rewrite changes the recipe's in-flight cap, staleness bound and server batch size."""
    notes = []
    sequences = sum(g.concurrency * g.count for g in plan.rollout.replicas)
    old, new = config.rollout.max_concurrent_rollouts, plan.staleness.max_concurrent_rollouts
    if old != new:
        notes.append(
            f"rollout.max_concurrent_rollouts: {old} -> {new}: the planned servers decode {sequences} sequences "
            f"at once; upstream counts rollouts (gconfig.n_samples={config.gconfig.n_samples} samples each, "
            "holding the slot until the longest ends), and this many keep the servers full"
        )
    old, new = config.rollout.max_head_offpolicyness, plan.staleness.max_head_offpolicyness
    if old != new:
        notes.append(f"rollout.max_head_offpolicyness: {old} -> {new}: the plan was made for eta={new}")
    window = plan.solver.window_steps
    if window > 1:
        notes.append(
            f"weights go to the rollout servers every {window} training steps (upstream: every step): the plan "
            "chose this window under eta, paying one weight sync and one KV rebuild per window; the servers' "
            "version advances with their weights, so upstream's staleness bound still holds"
        )
    running = config.sglang.max_running_requests
    if running is not None and any(g.concurrency != running for g in plan.rollout.replicas):
        notes.append(
            f"sglang.max_running_requests: {running} -> each server's planned concurrency (see the placement)"
        )
    return notes
