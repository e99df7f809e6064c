"""The route a weight update takes: plain data the integration side fills from the plan.

Every destination pool gets each byte once over its (slow) cross-pool link, to the first live replica of the
pool (the relay), which passes it down a pipelined chain over the pool's fast links to the other replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_hex_plugin.errors import HexError


@dataclass(frozen=True)
class Endpoint:
    """Where one replica's receiver listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str, field_name: str = "endpoint") -> Endpoint:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise HexError(field_name, f"{text!r} is not HOST:PORT", "write it as e.g. 10.0.0.5:29700")
        return cls(host.strip("[]"), int(port))


@dataclass
class PoolRoute:
    """One destination pool: its replicas in chain order and its link speeds (GB/s, 1e9 bytes/s)."""

    name: str
    replicas: list[Endpoint]
    cross_gb_per_s: float
    intra_gb_per_s: float


@dataclass
class Route:
    """All destination pools of one sender."""

    pools: list[PoolRoute] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[Endpoint] = set()
        for index, pool in enumerate(self.pools):
            where = f"hex.transport.route.pools[{index}]"
            if not pool.replicas:
                raise HexError(f"{where}.replicas", f"pool {pool.name!r} has no replica", "list at least one")
            if pool.cross_gb_per_s <= 0 or pool.intra_gb_per_s <= 0:
                raise HexError(f"{where}", "link speeds must be positive", "give GB/s figures above 0")
            for endpoint in pool.replicas:
                if endpoint in seen:
                    raise HexError(
                        f"{where}.replicas", f"{endpoint} appears twice", "list each receiver once"
                    )
                seen.add(endpoint)

    @property
    def replica_count(self) -> int:
        return sum(len(pool.replicas) for pool in self.pools)

    def bound_s(self, nbytes: int) -> float:
        """Lower bound: the bytes over each pool's cross link, the slowest pool decides."""
        return max(nbytes / (pool.cross_gb_per_s * 1e9) for pool in self.pools)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pools": [
                {
                    "name": pool.name,
                    "replicas": [str(endpoint) for endpoint in pool.replicas],
                    "cross_gb_per_s": pool.cross_gb_per_s,
                    "intra_gb_per_s": pool.intra_gb_per_s,
                }
                for pool in self.pools
            ]
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Route:
        pools = []
        for index, pool in enumerate(data.get("pools", [])):
            where = f"hex.transport.route.pools[{index}]"
            pools.append(
                PoolRoute(
                    name=str(pool.get("name", f"pool{index}")),
                    replicas=[Endpoint.parse(text, f"{where}.replicas") for text in pool.get("replicas", [])],
                    cross_gb_per_s=float(pool.get("cross_gb_per_s", 0.0)),
                    intra_gb_per_s=float(pool.get("intra_gb_per_s", 0.0)),
                )
            )
        return cls(pools)
