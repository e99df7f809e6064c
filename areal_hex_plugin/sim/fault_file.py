"""A faults file (``simulate --faults``): timed events, checked field by field and resolved against the plan.

The events and how each is played are described in ``sim/faults.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.specs import typed
from areal_hex_plugin.specs.config import SECONDS
from areal_hex_plugin.specs.typed import above, between, spec

# Events of one faults file: enough for a day of losses on thousands of machines.
MAX_EVENTS = 100_000
KINDS = ("lost", "back", "gained", "length_scale")


@dataclass
class FaultEvent:
    """One timed event of a faults file."""

    at_s: float = spec(help="when it happens: seconds from the start of the run", range=between(0, 1e9, "s"))
    lost: str | None = spec(None, "a machine of the plan is lost (its host name)")
    back: str | None = spec(None, "a lost rollout machine returns (its host name)")
    gained: str | None = spec(None, "one more machine of this pool generates, in the pool's planned layout")
    length_scale: float | None = spec(
        None, "output lengths drawn from now on are the recipe's times this", above(0, 1000)
    )
    recovery_s: float | None = spec(
        None, "a lost training machine: seconds until its replacement trains (default: its pool's)", SECONDS
    )


@dataclass(frozen=True)
class Fault:
    """An event resolved against the plan: the replicas it touches and whether it stops training."""

    at_s: float
    kind: str  # one of KINDS
    target: str  # the host, the pool, or the scale
    replicas: tuple[int, ...] = ()  # lost/back: replica indices; gained: the replica group joined
    trains: bool = False
    recovery_s: float = 0.0
    scale: float = 1.0


def read_faults(path: str, recipe, plan: HexPlan) -> list[Fault]:
    """The events of the faults file at ``path``, resolved against ``plan``, by time; HexError naming the field."""
    from areal_hex_plugin.specs.recipe import read_yaml

    data = read_yaml(path, "--faults")
    if set(data) != {"faults"} or not isinstance(data["faults"], list) or not data["faults"]:
        raise HexError(
            "faults",
            f"{path} must hold one key, faults: a list of events",
            "see recipes/faults/lost_machines.yml",
        )
    if len(data["faults"]) > MAX_EVENTS:
        raise HexError("faults", f"has {len(data['faults']):,} events", f"give at most {MAX_EVENTS:,}")
    events = [typed.build(FaultEvent, item, f"faults[{i}]") for i, item in enumerate(data["faults"])]
    return _Resolver(recipe, plan).resolve(events)


class _Resolver:
    """Hosts and pools of the events against the plan, and the order of losses and returns."""

    def __init__(self, recipe, plan: HexPlan) -> None:
        self.recipe, self.plan = recipe, plan
        first = [sum(g.count for g in plan.rollout.replicas[:k]) for k in range(len(plan.rollout.replicas))]
        self.replicas: dict[str, set[int]] = {}
        self.trains: set[str] = set()
        self.pool_of = {m.host: m.pool for m in plan.machines}
        for m in plan.machines:
            for a in m.gpus:
                if a.role == "rollout":
                    self.replicas.setdefault(m.host, set()).add(first[a.group] + a.instance)
                elif a.role == "train":
                    self.trains.add(m.host)

    def resolve(self, events: list[FaultEvent]) -> list[Fault]:
        order = sorted(range(len(events)), key=lambda i: (events[i].at_s, i))
        lost: set[str] = set()
        faults = []
        for i in order:
            event, where = events[i], f"faults[{i}]"
            kinds = [k for k in KINDS if getattr(event, k) is not None]
            if len(kinds) != 1:
                raise HexError(
                    where,
                    f"gives {' and '.join(kinds) or 'no event'}",
                    f"give exactly one of {', '.join(KINDS)}",
                )
            kind = kinds[0]
            if event.recovery_s is not None and kind != "lost":
                raise HexError(
                    f"{where}.recovery_s", f"is for a lost training machine, not {kind}", "drop it"
                )
            faults.append(getattr(self, f"_{kind}")(event, f"{where}.{kind}", lost))
        return faults

    def _host(self, host: str, where: str) -> None:
        if host not in self.pool_of:
            hosts = sorted(self.pool_of)
            raise HexError(
                where,
                f"{host!r} is not a machine of the plan",
                f"use one of {', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''}",
            )

    def _lost(self, event: FaultEvent, where: str, lost: set[str]) -> Fault:
        host = event.lost
        self._host(host, where)
        if host in lost:
            raise HexError(where, f"{host!r} is lost already at {event.at_s:g} s", "bring it back first")
        trains = host in self.trains
        replicas = tuple(sorted(self.replicas.get(host, ())))
        if not trains and not replicas:
            raise HexError(
                where, f"{host!r} is idle in the plan: losing it changes nothing", "lose a busy machine"
            )
        recovery = 0.0
        if trains:
            pool = self.recipe.cluster.pool(self.pool_of[host])
            recovery = event.recovery_s if event.recovery_s is not None else pool.recovery_s
            if not recovery:
                raise HexError(
                    where.replace(".lost", ".recovery_s"),
                    f"is missing: {host!r} trains and its pool {pool.name!r} is not preemptible (no recovery_s)",
                    "give the seconds until a replacement machine trains, e.g. recovery_s: 600",
                )
        if replicas:
            lost.add(host)
        return Fault(event.at_s, "lost", host, replicas, trains, recovery)

    def _back(self, event: FaultEvent, where: str, lost: set[str]) -> Fault:
        host = event.back
        self._host(host, where)
        if host not in lost:
            raise HexError(
                where,
                f"{host!r} is not a lost rollout machine at {event.at_s:g} s",
                "lose it earlier (a training machine's replacement comes back by itself after recovery_s)",
            )
        lost.discard(host)
        return Fault(event.at_s, "back", host, tuple(sorted(self.replicas[host])))

    def _gained(self, event: FaultEvent, where: str, lost: set[str]) -> Fault:
        groups = [k for k, g in enumerate(self.plan.rollout.replicas) if g.pool == event.gained]
        if not groups:
            pools = sorted({g.pool for g in self.plan.rollout.replicas})
            raise HexError(
                where,
                f"pool {event.gained!r} generates nothing in the plan",
                f"use one of {', '.join(pools)}",
            )
        return Fault(event.at_s, "gained", event.gained, (groups[0],))

    def _length_scale(self, event: FaultEvent, where: str, lost: set[str]) -> Fault:
        return Fault(event.at_s, "length_scale", f"x{event.length_scale:g}", scale=event.length_scale)
