"""Cluster inventory: pools of identical machines and the links between them."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.catalog import GpuCatalog, GpuSpec
from areal_hex_plugin.specs.config import MAX_CLUSTER_GPUS, ClusterConfig, PoolConfig

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
# A DNS name, an address, or a scheduler's node name (Ray's look like vm#46985a57): no spaces, at most 253.
_HOST = re.compile(r"^[!-~]{1,253}$")


@dataclass(frozen=True)
class Pool:
    name: str
    gpu: GpuSpec
    gpus_per_machine: int
    machines: int
    hosts: tuple[str, ...]
    price_per_gpu_hour: float
    intra_machine_gb_per_s: float
    inter_machine_gb_per_s: float
    preemptions_per_hour: float = 0.0  # expected losses per machine-hour; 0: a reliable pool
    recovery_s: float = 0.0  # from a loss until the replacement machine serves

    @property
    def preemptible(self) -> bool:
        return self.preemptions_per_hour > 0

    @property
    def gpu_type(self) -> str:
        return self.gpu.name

    @property
    def n_gpus(self) -> int:
        return self.gpus_per_machine * self.machines

    @property
    def price_per_machine_hour(self) -> float:
        return self.price_per_gpu_hour * self.gpus_per_machine

    def host(self, index: int) -> str:
        """Host name of machine ``index`` (a placeholder name when the pool gives only a count)."""
        return self.hosts[index] if self.hosts else f"{self.name}-{index}"


# Machines in play up to which the planner may split a machine's GPUs between training and rollout
# (planner/split.py: shared_choices); on more machines roles are whole machines.
SHARED_MACHINES = 3


@dataclass(frozen=True)
class Cluster:
    pools: tuple[Pool, ...]
    cross_pool_gb_per_s: float
    # Pair overrides, keyed by the sorted pair of pool names.
    links: dict[tuple[str, str], float] = field(default_factory=dict)

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)

    def link_gb_per_s(self, a: str, b: str) -> float:
        """Machine-to-machine bandwidth between pools ``a`` and ``b`` (inside one pool when a == b)."""
        if a == b:
            return self.pool(a).inter_machine_gb_per_s
        return self.links.get(tuple(sorted((a, b))), self.cross_pool_gb_per_s)

    @property
    def n_gpus(self) -> int:
        return sum(p.n_gpus for p in self.pools)

    @property
    def price_per_hour(self) -> float:
        return sum(p.n_gpus * p.price_per_gpu_hour for p in self.pools)

    @property
    def gpu_types(self) -> list[str]:
        return sorted({p.gpu_type for p in self.pools})


def build_pool(cfg: PoolConfig, catalog: GpuCatalog, path: str) -> Pool:
    if not cfg.name:
        raise HexError(f"{path}.name", "is missing", "name the pool, e.g. 'h20' (letters, digits, - and _)")
    if not _NAME.match(cfg.name):
        raise HexError(
            f"{path}.name",
            f"{cfg.name!r} is not a valid pool name",
            "use letters, digits, - and _ (up to 64)",
        )
    if not cfg.gpu_type:
        raise HexError(f"{path}.gpu_type", "is missing", f"set it to one of {', '.join(catalog.names)}")
    gpu = catalog.get(cfg.gpu_type, f"{path}.gpu_type")
    for i, host in enumerate(cfg.hosts):
        if not _HOST.match(host):
            raise HexError(
                f"{path}.hosts[{i}]",
                f"{host!r} is not a host name",
                "give the machine's name or address (printable, no spaces, up to 253 characters)",
            )
    if cfg.hosts:
        if len(set(cfg.hosts)) != len(cfg.hosts):
            raise HexError(f"{path}.hosts", "lists a host twice", "list each machine once")
        if cfg.machines is not None and cfg.machines != len(cfg.hosts):
            raise HexError(
                f"{path}.machines",
                f"is {cfg.machines} but hosts lists {len(cfg.hosts)} machines",
                "give either machines or hosts, or make them agree",
            )
        machines = len(cfg.hosts)
    else:
        if cfg.machines is None:
            raise HexError(f"{path}.machines", "is missing", "give the machine count, or list the hosts")
        machines = cfg.machines
    if cfg.price_per_gpu_hour is None:
        raise HexError(
            f"{path}.price_per_gpu_hour",
            "is missing",
            "give what one GPU-hour of this pool costs you (there are no default prices)",
        )
    intra = gpu.link_gb_per_s if cfg.intra_machine_gb_per_s is None else cfg.intra_machine_gb_per_s
    _check_preemption(cfg, path)
    return Pool(
        name=cfg.name,
        gpu=gpu,
        gpus_per_machine=cfg.gpus_per_machine,
        machines=machines,
        hosts=tuple(cfg.hosts),
        price_per_gpu_hour=cfg.price_per_gpu_hour,
        intra_machine_gb_per_s=intra,
        inter_machine_gb_per_s=cfg.inter_machine_gb_per_s,
        preemptions_per_hour=cfg.preemptions_per_hour if cfg.preemptible else 0.0,
        recovery_s=cfg.recovery_s if cfg.preemptible else 0.0,
    )


def _check_preemption(cfg: PoolConfig, path: str) -> None:
    """A preemptible pool gives its loss rate and recovery time; a reliable one gives neither."""
    for name, example in (("preemptions_per_hour", "0.05"), ("recovery_s", "300")):
        value = getattr(cfg, name)
        if cfg.preemptible and value is None:
            raise HexError(
                f"{path}.{name}", "is missing for a preemptible pool", f"give it, e.g. {name}: {example}"
            )
        if not cfg.preemptible and value is not None:
            raise HexError(
                f"{path}.{name}",
                "is set but the pool is not preemptible",
                "add preemptible: true to the pool, or drop the field",
            )


def build_cluster(cfg: ClusterConfig, catalog: GpuCatalog, path: str = "hex.cluster") -> Cluster:
    if not cfg.pools:
        raise HexError(f"{path}.pools", "is empty", "describe at least one pool of machines (see recipes/)")
    pools = tuple(build_pool(p, catalog, f"{path}.pools[{i}]") for i, p in enumerate(cfg.pools))
    seen: set[str] = set()
    for i, pool in enumerate(pools):
        if pool.name in seen:
            raise HexError(
                f"{path}.pools[{i}].name", f"pool {pool.name!r} is named twice", "give pools unique names"
            )
        seen.add(pool.name)
    total = sum(p.n_gpus for p in pools)
    if total > MAX_CLUSTER_GPUS:
        raise HexError(
            f"{path}.pools",
            f"hold {total:,} GPUs, more than {MAX_CLUSTER_GPUS:,}",
            "describe the machines you will rent (check machines and gpus_per_machine)",
        )
    hosts = [h for p in pools for h in p.hosts]
    duplicated = sorted(h for h, n in Counter(hosts).items() if n > 1)
    if duplicated:
        raise HexError(
            f"{path}.pools", f"host {duplicated[0]!r} is in two pools", "put each machine in one pool"
        )
    links: dict[tuple[str, str], float] = {}
    for i, link in enumerate(cfg.links):
        lpath = f"{path}.links[{i}]"
        if len(link.pools) != 2 or link.pools[0] == link.pools[1]:
            raise HexError(f"{lpath}.pools", "must name two different pools", "write pools: [POOL_A, POOL_B]")
        for name in link.pools:
            if name not in seen:
                raise HexError(
                    f"{lpath}.pools", f"unknown pool {name!r}", f"use one of {', '.join(sorted(seen))}"
                )
        if link.gb_per_s is None:
            raise HexError(f"{lpath}.gb_per_s", "is missing", "give the link's bandwidth in GB/s")
        links[tuple(sorted(link.pools))] = link.gb_per_s
    return Cluster(pools=pools, cross_pool_gb_per_s=cfg.cross_pool_gb_per_s, links=links)
