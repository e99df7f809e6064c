"""Inventory discovery: find the GPU machines of a running cluster and write a ``hex: cluster:`` section.

Three sources: a running Ray cluster (each node's ``GPU`` and ``accelerator_type:<X>`` resources), Slurm
(``sinfo`` node lines with GRES and features) and the local machine (``nvidia-smi``, or the GPUs that
``HEX_LOCAL_GPUS`` declares). Machines are grouped into pools by GPU type and GPUs per machine. Prices are never guessed: each pool's ``price_per_gpu_hour`` is
left empty and marked for the user, and the recipe loader rejects it until it is filled in.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections import defaultdict
from dataclasses import dataclass, replace

import yaml

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.catalog import GpuCatalog, build_catalog

# ``sinfo -N -h -o`` format: node, GRES, features, partition (one line per node and partition).
SINFO_FORMAT = "%N|%G|%f|%P"
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"]
TOOL_TIMEOUT_S = 30
# Declares this machine's GPUs (``H100:2,L40S:2``) instead of asking nvidia-smi: for CPU-only test runs of
# hex_local (the run's processes get the declared GPU ids but compute on CPU) and machines without nvidia-smi.
LOCAL_GPUS_ENV = "HEX_LOCAL_GPUS"
PRICE_MARK = "FILL IN: what one GPU-hour of this pool costs you"


@dataclass(frozen=True)
class Machine:
    """One discovered machine: its host name, GPU type as the source spelled it, and GPU count."""

    host: str
    gpu_name: str
    gpus: int
    partitions: tuple[str, ...] = ()
    typed_gres: bool = True  # Slurm: the GRES names the GPU type (else a node feature does)


@dataclass(frozen=True)
class DiscoveredPool:
    name: str
    gpu_type: str
    gpus_per_machine: int
    hosts: tuple[str, ...]
    known_type: bool
    partitions: tuple[str, ...] = ()
    typed_gres: bool = True  # Slurm: the GRES names the GPU type (else a node feature does)


def canonical_gpu_type(name: str, catalog: GpuCatalog) -> str:
    """The catalog name for a GPU as NVML, Slurm or Ray spell it (``NVIDIA GeForce RTX 4090``), else ``name``."""
    return catalog.canonical(name) or name


def group_pools(machines: list[Machine], catalog: GpuCatalog | None = None) -> list[DiscoveredPool]:
    """Group machines into pools of identical machines (same GPU type and GPUs per machine)."""
    catalog = catalog or build_catalog()
    groups: dict[tuple[str, int], list[Machine]] = defaultdict(list)
    for machine in machines:
        if machine.gpus <= 0:
            continue
        gpu_type = canonical_gpu_type(machine.gpu_name, catalog)
        groups[(gpu_type, machine.gpus)].append(machine)
    if not groups:
        raise HexError(
            "inventory", "found no machine with GPUs", "check that the cluster is up and has GPU nodes"
        )
    per_type: dict[str, int] = defaultdict(int)
    for gpu_type, _ in groups:
        per_type[gpu_type] += 1
    pools = []
    for (gpu_type, gpus), members in sorted(groups.items()):
        base = re.sub(r"[^a-z0-9]+", "-", gpu_type.lower()).strip("-") or "gpu"
        name = base if per_type[gpu_type] == 1 else f"{base}-x{gpus}"
        hosts = tuple(sorted({m.host for m in members}))
        partitions = tuple(sorted({part for m in members for part in m.partitions}))
        pools.append(DiscoveredPool(name, gpu_type, gpus, hosts, gpu_type in catalog, partitions))
    return pools


def render_cluster_yaml(pools: list[DiscoveredPool], source: str) -> str:
    """The ``hex: cluster:`` YAML for ``pools``, with every price marked for the user to fill in."""
    section = {
        "hex": {
            "cluster": {
                "pools": [
                    {
                        "name": p.name,
                        "gpu_type": p.gpu_type,
                        "gpus_per_machine": p.gpus_per_machine,
                        "hosts": list(p.hosts),
                        "price_per_gpu_hour": None,
                    }
                    for p in pools
                ]
            }
        }
    }
    lines = [
        f"# Discovered by `areal-hex inventory --from {source}`.",
        "# Fill in price_per_gpu_hour for every pool (the recipe loader rejects an empty price), then paste",
        "# this hex: section into your recipe. Bandwidths take their defaults; set them if you know better.",
    ]
    unknown = {p.name: p.gpu_type for p in pools if not p.known_type}
    for name, gpu_type in unknown.items():
        lines.append(
            f"# Pool {name}: GPU type {gpu_type!r} is not in the catalog; describe it under "
            f"hex.gpu_catalog.{gpu_type} (tflops_bf16, hbm_gb, hbm_tb_per_s, link_gb_per_s)."
        )
    partitions = {p.name: p.partitions for p in pools if p.partitions}
    for name, parts in partitions.items():
        lines.append(f"# Pool {name}: Slurm partition(s) {', '.join(parts)}.")
    body = yaml.safe_dump(section, sort_keys=False, default_flow_style=False)
    body = body.replace("price_per_gpu_hour: null", f"price_per_gpu_hour: null  # {PRICE_MARK}")
    return "\n".join(lines) + "\n" + body


# ---- Ray -------------------------------------------------------------------------------------------------


def machines_from_ray_nodes(nodes: list[dict]) -> list[Machine]:
    """Machines from ``ray.nodes()`` records (alive nodes with a ``GPU`` resource).

    Several Ray nodes on one host (a split machine, or a test cluster) are told apart by node id.
    """
    found: list[tuple[str, str, str, int]] = []
    for node in nodes:
        resources = node.get("Resources", {})
        gpus = int(resources.get("GPU", 0))
        if not node.get("Alive", False) or gpus <= 0:
            continue
        node_id = node.get("NodeID", "?")
        types = [key.split(":", 1)[1] for key in resources if key.startswith("accelerator_type:")]
        if len(types) != 1:
            raise HexError(
                f"ray node {node_id[:12]}",
                f"has {gpus} GPUs but {'no' if not types else 'several'} accelerator_type resources",
                "start the node with `ray start --resources '{\"accelerator_type:<GPU>\": 1}'` "
                "or let Ray detect the GPU type",
            )
        host = node.get("NodeManagerHostname") or node.get("NodeManagerAddress") or node_id[:12]
        found.append((host, node_id, types[0], gpus))
    per_host = defaultdict(int)
    for host, *_ in found:
        per_host[host] += 1
    return [
        Machine(host if per_host[host] == 1 else f"{host}#{node_id[:8]}", gpu_name, gpus)
        for host, node_id, gpu_name, gpus in found
    ]


def machines_from_ray(address: str | None) -> list[Machine]:
    """Connect to a running Ray cluster (``address`` or ``auto``) and read its GPU nodes."""
    return machines_from_ray_nodes(ray_nodes(address))


def ray_nodes(address: str | None) -> list[dict]:
    """The node records of a running Ray cluster (``address`` or ``auto``), as ``ray.nodes()`` gives them."""
    import ray

    was_initialized = ray.is_initialized()
    if not was_initialized:
        try:
            ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError) as exc:
            raise HexError(
                "--address",
                f"cannot connect to a Ray cluster at {address or 'auto'}: {exc}",
                "start Ray (`ray start --head`) or give --address HOST:PORT; a cluster with token authentication "
                "(Ray's default for clusters that ray.init starts) also needs RAY_AUTH_MODE=token and its "
                "RAY_AUTH_TOKEN exported",
            ) from None
    try:
        return ray.nodes()
    finally:
        if not was_initialized:
            ray.shutdown()


# ---- Slurm -----------------------------------------------------------------------------------------------

_GRES_GPU = re.compile(r"gpu(?::(?P<type>[A-Za-z][\w.-]*))?:(?P<count>\d+)")


def machines_from_sinfo(text: str, catalog: GpuCatalog | None = None) -> list[Machine]:
    """Machines from ``sinfo -N -h -o '%N|%G|%f|%P'`` output.

    The GPU type comes from the typed GRES (``gpu:a100:8``); an untyped GRES (``gpu:8``) takes it from the
    node's features (``a100,ib``). A node in several partitions is one machine.
    """
    catalog = catalog or build_catalog()
    machines: dict[str, Machine] = {}
    partitions: dict[str, set[str]] = defaultdict(set)
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.strip().split("|")
        if len(fields) != 4:
            raise HexError(
                f"sinfo line {lineno}",
                f"expected 4 '|'-separated fields, got {line!r}",
                f"run sinfo -N -h -o '{SINFO_FORMAT}'",
            )
        node, gres, features, partition = (f.strip() for f in fields)
        partitions[node].add(partition.rstrip("*"))
        match = _GRES_GPU.search(gres)
        if match is None:
            continue
        gpu_name = match.group("type")
        typed = gpu_name is not None
        if not typed:
            named = [f for f in features.split(",") if f and catalog.canonical(f)]
            if not named:
                raise HexError(
                    f"sinfo node {node}",
                    f"GRES {gres!r} has no GPU type and its features {features!r} name none",
                    "declare typed GRES (Gres=gpu:<type>:<n>) or a GPU-type feature in slurm.conf",
                )
            gpu_name = named[0]
        machines[node] = Machine(node, gpu_name, int(match.group("count")), typed_gres=typed)
    return [replace(m, partitions=tuple(sorted(partitions[m.host]))) for m in machines.values()]


def machines_from_slurm() -> list[Machine]:
    if shutil.which("sinfo") is None:
        raise HexError("--from slurm", "sinfo is not on PATH", "run this on a Slurm login node")
    out = _run_tool(
        ["sinfo", "-N", "-h", "-o", SINFO_FORMAT], "--from slurm", "check that slurmctld is reachable"
    )
    if out.returncode != 0:
        raise HexError("--from slurm", f"sinfo failed: {out.stderr.strip()}", "check that Slurm is reachable")
    return machines_from_sinfo(out.stdout)


# ---- local NVML (nvidia-smi) -----------------------------------------------------------------------------


def machines_from_nvidia_smi(text: str, host: str) -> list[Machine]:
    """The local machine from ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader``.

    A machine with two GPU types shows up as two machines of one pool each (same host, distinct suffix).
    """
    counts: dict[str, int] = defaultdict(int)
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 2 or not fields[0].isdigit():
            raise HexError(
                f"nvidia-smi line {lineno}", f"unexpected line {line!r}", f"run {' '.join(NVIDIA_SMI_QUERY)}"
            )
        counts[fields[1]] += 1
    return _local_machines(counts, host)


def machines_from_declared(text: str, host: str) -> list[Machine]:
    """This machine's GPUs as ``HEX_LOCAL_GPUS`` declares them (``TYPE:N[,TYPE:N...]``), instead of nvidia-smi."""
    counts: dict[str, int] = defaultdict(int)
    for item in text.split(","):
        name, _, n = item.strip().rpartition(":")
        if not name or not n.isdigit() or int(n) <= 0:
            raise HexError(
                LOCAL_GPUS_ENV,
                f"{item.strip()!r} is not TYPE:N with N a positive count (whole value {text!r})",
                f"write e.g. {LOCAL_GPUS_ENV}=H100:2,L40S:2, or unset it to ask nvidia-smi",
            )
        counts[name.strip()] += int(n)
    return _local_machines(counts, host)


def _local_machines(counts: dict[str, int], host: str) -> list[Machine]:
    if len(counts) == 1:
        return [Machine(host, name, n) for name, n in counts.items()]
    return [Machine(f"{host}#{i}", name, n) for i, (name, n) in enumerate(sorted(counts.items()))]


def machines_from_local() -> list[Machine]:
    """This machine's GPUs: declared in ``HEX_LOCAL_GPUS`` if set, else found by nvidia-smi."""
    declared = os.environ.get(LOCAL_GPUS_ENV)
    if declared:
        return machines_from_declared(declared, socket.gethostname())
    if shutil.which("nvidia-smi") is None:
        raise HexError("--from local", "nvidia-smi is not on PATH", "run this on a machine with NVIDIA GPUs")
    out = _run_tool(NVIDIA_SMI_QUERY, "--from local", "check the NVIDIA driver")
    if out.returncode != 0:
        raise HexError("--from local", f"nvidia-smi failed: {out.stderr.strip()}", "check the NVIDIA driver")
    return machines_from_nvidia_smi(out.stdout, socket.gethostname())


@dataclass(frozen=True)
class LiveInventory:
    """A live cluster's machines as read once; for Ray also its node records, whose resources pin workers."""

    source: str
    machines: tuple[Machine, ...]
    ray_nodes: tuple[dict, ...] = ()


def read_inventory(source: str, address: str | None = None) -> LiveInventory:
    """The machines of ``source`` (``ray`` at ``address``, ``slurm`` or ``local``)."""
    if source == "ray":
        nodes = ray_nodes(address)
        return LiveInventory(source, tuple(machines_from_ray_nodes(nodes)), tuple(nodes))
    read = {"slurm": machines_from_slurm, "local": machines_from_local}.get(source)
    if read is None:
        raise HexError("--from", f"unknown source {source!r}", "use ray, slurm or local")
    return LiveInventory(source, tuple(read()))


def discover(source: str, address: str | None = None) -> list[DiscoveredPool]:
    """Pools found on ``source`` (``ray``, ``slurm`` or ``local``)."""
    return group_pools(list(read_inventory(source, address).machines))


def _run_tool(cmd: list[str], field: str, fix: str) -> subprocess.CompletedProcess:
    """Run an inventory tool, bounded in time: an unreachable controller must not hang the command."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HexError(field, f"{cmd[0]} gave no answer within {TOOL_TIMEOUT_S}s", fix) from None
