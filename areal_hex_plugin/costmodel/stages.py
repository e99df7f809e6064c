"""Checks every pipeline layout must pass, for rollout replicas and trainers alike."""

from __future__ import annotations

from collections.abc import Sequence

from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.models import ModelShape


def layout_problem(
    cluster: Cluster, model: ModelShape, stages: Sequence[tuple[str, int, int]], what: str
) -> str:
    """Why a pipeline of ``(pool, tp, GPUs)`` stages cannot run, or "" when it can: known pools, no more stages
    than layers, TP inside one machine and dividing the attention heads, and no pool asked for more GPUs than it
    has."""
    if not stages:
        return f"a {what} needs at least one stage"
    if len(stages) > model.layers:
        return f"{len(stages)} pipeline stages for {model.layers} layers"
    names = {p.name for p in cluster.pools}
    used: dict[str, int] = {}
    for name, tp, gpus in stages:
        if name not in names:
            return f"unknown pool {name!r} (pools: {', '.join(sorted(names))})"
        pool = cluster.pool(name)
        if tp > pool.gpus_per_machine:
            return f"TP{tp} does not fit one {pool.name} machine of {pool.gpus_per_machine} GPUs"
        if model.heads % tp:
            return f"TP{tp} does not divide {model.name}'s {model.heads} attention heads"
        used[name] = used.get(name, 0) + gpus
    for name, count in used.items():
        if count > cluster.pool(name).n_gpus:
            return f"needs {count} GPUs of pool {name}, which has {cluster.pool(name).n_gpus}"
    return ""
