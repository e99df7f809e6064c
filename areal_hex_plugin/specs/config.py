"""The ``hex:`` section of a recipe, as plain dataclasses.

The same classes serve both readers: the core loads them with omegaconf (no areal import), and the integration
side nests :class:`HexConfig` in ``HexGRPOConfig(GRPOConfig)`` so upstream's ``load_expr_config`` loads the very same
recipe. Units: bandwidths in GB/s (1e9 bytes/s) per direction, prices in $ per GPU-hour, times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_hex_plugin.errors import HexError


@dataclass
class GpuTypeConfig:
    """Override catalog figures of a GPU type, or describe a new one (then all four are needed)."""

    tflops_bf16: float | None = None
    hbm_gb: float | None = None
    hbm_tb_per_s: float | None = None
    link_gb_per_s: float | None = None


@dataclass
class PoolConfig:
    """A pool of identical machines."""

    name: str = ""
    gpu_type: str = ""
    gpus_per_machine: int = 8
    # Either a machine count or the host names (then the count is their number).
    machines: int | None = None
    hosts: list[str] = field(default_factory=list)
    # User input: prices differ by provider and contract, so there is no default.
    price_per_gpu_hour: float | None = None
    # GPU-to-GPU bandwidth inside one machine; None takes the catalog's link figure.
    intra_machine_gb_per_s: float | None = None
    # Machine-to-machine bandwidth inside the pool (100 GbE = 12.5 GB/s).
    inter_machine_gb_per_s: float = 12.5


@dataclass
class LinkConfig:
    """Bandwidth between two pools, overriding ``cluster.cross_pool_gb_per_s`` for that pair."""

    pools: list[str] = field(default_factory=list)
    gb_per_s: float = 0.0


@dataclass
class ClusterConfig:
    pools: list[PoolConfig] = field(default_factory=list)
    # Default machine-to-machine bandwidth between different pools (the paper's H800<->H20 figure).
    cross_pool_gb_per_s: float = 1.5
    links: list[LinkConfig] = field(default_factory=list)


@dataclass
class OutputLengthConfig:
    """Distribution of generated tokens per sample.

    ``lognormal``: a long tail with the given mean and log-space sigma, truncated at ``gconfig.max_new_tokens``.
    ``file``: profiled lengths, one integer per line (or a JSON list), at ``path``.
    """

    kind: str = "lognormal"
    mean_tokens: float | None = None
    sigma: float = 0.8
    path: str | None = None


@dataclass
class WorkloadConfig:
    # A built-in model name or a local HF model directory / config.json; None takes ``actor.path``.
    model: str | None = None
    # Mean prompt length in tokens; None takes half of ``train_dataset.max_length`` (or 512).
    prompt_tokens: int | None = None
    output_lengths: OutputLengthConfig = field(default_factory=OutputLengthConfig)
    # Reward: CPU-seconds per sample spread over reward_cpus cores (rule-based math: about 0).
    reward_cpu_s_per_sample: float = 0.0
    reward_cpus: int = 16


@dataclass
class ObjectiveConfig:
    """What to optimise. Neither set: max tokens/s on the whole inventory."""

    # Max tokens/s under this $/h, choosing which machines of the inventory to use.
    budget_per_hour: float | None = None
    # Min $/h reaching this tokens/s.
    target_tokens_per_s: float | None = None


@dataclass
class SolverConfig:
    time_limit_s: float = 60.0
    num_workers: int = 2
    seed: int = 0
    # Stop the repartition loop once max(C_T, C_I) is stable for this many iterations (the paper's K).
    stable_iterations: int = 20
    max_pp_stages: int = 4
    # [tp, pp]: every rollout replica uses this one layout (upstream runs all rollout servers alike); empty: free.
    rollout_layout: list[int] = field(default_factory=list)


@dataclass
class GpuEfficiencyConfig:
    """Calibration factors of one GPU type (each in (0, 1]); unset ones keep the profile's or the default."""

    train_mfu: float | None = None
    infer_mfu: float | None = None
    hbm_fraction: float | None = None
    link_efficiency: float | None = None


@dataclass
class CalibrationConfig:
    """Cost-model efficiency factors: defaults, then a profile JSON (``areal-hex profile``), then these."""

    profile: str | None = None
    gpu_types: dict[str, GpuEfficiencyConfig] = field(default_factory=dict)


ROUTING_POLICIES = ("shares", "least_outstanding")
# The relay transport's choices; areal_hex_plugin.transport checks against these same tuples.
RELAY_BACKENDS = ("tcp", "gloo", "nccl")
RELAY_ON_FAILURE = ("reroute", "fail")


def check_relay_sender(
    backend: str, on_failure: str, timeout_s: float, chunk_bytes: float, max_resends: int
) -> None:
    """Refuse sender options no relay can run with, naming the ``hex.relay`` field (the recipe reader and the
    transport's SenderConfig both call this)."""
    for name, value, allowed in (
        ("backend", backend, RELAY_BACKENDS),
        ("on_failure", on_failure, RELAY_ON_FAILURE),
    ):
        if value not in allowed:
            raise HexError(
                f"hex.relay.{name}", f"unknown value {value!r}", f"use one of {', '.join(allowed)}"
            )
    if timeout_s <= 0:
        raise HexError("hex.relay.timeout_s", f"must be positive, got {timeout_s}", "e.g. 30 (seconds)")
    if chunk_bytes <= 0:
        raise HexError(
            "hex.relay.chunk_mb", f"must be positive, got {chunk_bytes / 2**20:g} MiB", "e.g. 4 (MiB)"
        )
    if max_resends < 0:
        raise HexError(
            "hex.relay.max_resends", f"must be >= 0, got {max_resends}", "e.g. 3; 0 never re-sends"
        )


@dataclass
class RelayConfig:
    """Options of the relay weight transport (used when ``transport: relay``)."""

    # Payload link between neighbours on a route: "tcp" (works anywhere), "gloo", or "nccl" (CUDA on both ends).
    backend: str = "tcp"
    # A replica silent for this long, or a link that stops moving, counts as dead (sender and receivers).
    timeout_s: float = 30.0
    # Payload chunk in MiB: the unit each replica forwards down its chain as soon as it arrives.
    chunk_mb: int = 4
    # When a replica dies: "reroute" (drop it; the next one in its pool relays) or "fail" (abort everywhere).
    on_failure: str = "reroute"
    # Re-sends of a bucket that keeps failing its checksum at one replica before that replica counts as dead.
    max_resends: int = 3
    # The update fails when fewer than this fraction of replicas committed (the rest keep their old version).
    min_committed_fraction: float = 1.0
    # Peer addresses a receiver accepts; empty: any peer that proves AREAL_HEX_TRANSPORT_TOKEN.
    allowed_hosts: list[str] = field(default_factory=list)
    # Interface the receivers listen on (e.g. "ib0"), resolved to its IPv4 address on each rollout worker;
    # None: the worker's own address.
    bind_interface: str | None = None
    # Node-local directory a verified version is written to for SGLang to load (memory-backed by default).
    stage_dir: str = "/dev/shm/areal-hex"


@dataclass
class HexConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gpu_catalog: dict[str, GpuTypeConfig] = field(default_factory=dict)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    # Weight transport between GPU types: "relay" (ours) or "upstream" (AReaL's own xccl/disk path).
    transport: str = "relay"
    relay: RelayConfig = field(default_factory=RelayConfig)
    # How the rollout controller picks a server: "shares" (weighted round-robin by the plan's shares) or
    # "least_outstanding" (fewest requests in flight per unit of share; adapts when a server runs slow).
    routing: str = "shares"
    # Load this saved plan instead of solving at start.
    plan_path: str | None = None
    # Print the rewritten upstream config and the placement, then exit.
    dry_run: bool = False
