"""What a run prints at start, and all a dry run (``hex.dry_run=true``) prints: the plan table, the pre-flight's
checks (``areal-hex check``), the upstream config after the plan's rewrite, the placement table and every change
the plan made to the config, with its reason."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict

import yaml

from areal_hex_plugin.areal.rewrite import Rewrite
from areal_hex_plugin.areal.session import HexSession
from areal_hex_plugin.tables import render_table

SPEC_FIELDS = ("cpu", "gpu", "mem", "port_count", "cmd", "env_vars")


def _specs(specs) -> list[dict]:
    return [{k: v for k, v in asdict(s).items() if k in SPEC_FIELDS} for s in specs]


def rewritten_config(config) -> dict:
    """The upstream fields the plan rewrote, as they now stand."""
    out = {
        "scheduler": {"type": config.scheduler.type},
        "actor": {"backend": config.actor.backend, "scheduling_spec": _specs(config.actor.scheduling_spec)},
        "rollout": {
            "backend": config.rollout.backend,
            "max_concurrent_rollouts": config.rollout.max_concurrent_rollouts,
            "max_head_offpolicyness": config.rollout.max_head_offpolicyness,
            "scheduling_spec": _specs(config.rollout.scheduling_spec),
        },
    }
    for name in ("ref", "critic"):
        role_cfg = getattr(config, name, None)
        if role_cfg is not None:
            out[name] = {"backend": role_cfg.backend}
    return out


def placement_table(rewrite: Rewrite) -> str:
    """One row per training pool and per rollout replica group (pool, GPU type, layout), with the flags each of
    its servers starts with."""
    p = rewrite.placement
    rows = []
    for role, slots in p.slots.items():
        by_group: dict[tuple, list] = defaultdict(list)
        for slot in slots:
            by_group[(slot.pool, slot.gpu_type, slot.tp, slot.pp, slot.server_flags, slot.stage)].append(slot)
        for (pool, gpu_type, tp, pp, flags, stage), members in by_group.items():
            gpus = sum(len(s.gpu_ids) for s in members)
            hosts = sorted({s.host for s in members})
            if role == "actor":
                layers = members[0].pp_layers
                layout = f"dp{p.train_dp} tp{p.train_tp} pp{p.train_pp} ({gpus} ranks here)" + (
                    f", stage {stage}: {layers[stage]} of {sum(layers)} layers" if layers else ""
                )
            else:
                f = dict(flags)
                share = sum(s.share for s in members)
                layout = (
                    f"{len(members)} servers x tp{tp} pp{pp}, share {share:.1%}, "
                    f"max_running_requests={f.get('max_running_requests')} "
                    f"attn={f.get('attention_backend')} mem={f.get('mem_fraction_static')}"
                )
            machines = ", ".join(hosts) if len(hosts) <= 4 else f"{', '.join(hosts[:3])}, ... ({len(hosts)})"
            rows.append([role, pool, gpu_type, machines, gpus, layout])
    return render_table(
        ["role", "pool", "GPU type", "machines", "GPUs", "parallel layout"], rows, right=["GPUs"]
    )


def announce(session: HexSession) -> None:
    """Print what the run decided (:func:`describe_start`), once per session: the driver does before upstream
    starts anything, and so do a Hex scheduler or ``HexPPOTrainer`` that upstream builds from the config alone."""
    if not session.announced:
        session.announced = True
        print(describe_start(session, dry_run=False), flush=True)


def describe_start(session: HexSession, dry_run: bool) -> str:
    """What the run decided, before it starts anything (``dry_run``: and it starts nothing)."""
    from areal_hex_plugin.planner.report import describe_plan

    config, rewrite, plan = session.config, session.rewrite, session.plan
    head = (
        f"AReaL-Hex dry run ({session.plan_source}); nothing was started."
        if dry_run
        else f"AReaL-Hex run ({session.plan_source}): upstream AReaL starts the workers below."
    )
    lines = [
        head,
        "",
        "# Plan",
        describe_plan(plan),
        "",
        "# Pre-flight (areal-hex check)",
        *(f"ok   {line}" for line in session.passed),
        *(f"note {line}" for line in session.notes),
        "",
        "# Upstream config after the plan's rewrite",
        yaml.safe_dump(rewritten_config(config), sort_keys=False, default_flow_style=False).rstrip(),
        "",
        "# Placement",
        placement_table(rewrite),
        f"Rollout requests go to servers by hex.routing={rewrite.placement.routing}",
        "",
        f"Predicted: {plan.predicted.tokens_per_s:,.0f} tokens/s at ${plan.predicted.cost_per_hour:,.2f}/h "
        f"({plan.predicted.tokens_per_dollar:,.0f} tokens/$), step {plan.predicted.step_time_s:.1f}s",
    ]
    lines += [f"change: {n}" for n in rewrite.notes]
    lines += [f"note: {n}" for n in plan.warnings]
    return "\n".join(lines)
