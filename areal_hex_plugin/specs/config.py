"""The ``hex:`` section of a recipe, as plain dataclasses.

The same classes serve both readers: the core loads them with omegaconf (no areal import), and the integration
side nests :class:`HexConfig` in ``HexGRPOConfig(GRPOConfig)`` so upstream's ``load_expr_config`` loads the very same
recipe. Units: bandwidths in GB/s (1e9 bytes/s) per direction, prices in $ per GPU-hour, times in seconds.

Each field's metadata holds its help, its choices and its sane range (``specs/typed.py`` checks them where the
recipe enters). The ranges are what a real cluster can have, generously: a value outside one is a typo or a unit
mistake, and would otherwise reach the solver as an overflow or an endless search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.typed import above, between, meta_of, scalar, spec

# A GPU link or network between machines: NVLink 5 is 900 GB/s per direction; 10 TB/s leaves room.
BANDWIDTH = above(0, 10_000, "GB/s")
# A whole number of seconds, from a moment to a day.
SECONDS = above(0, 86_400, "s")
# Machines of one pool, and GPUs of the whole cluster: the largest training clusters today have about 100k GPUs.
MAX_MACHINES = 4096
MAX_CLUSTER_GPUS = 1 << 17


@dataclass
class GpuTypeConfig:
    """Override catalog figures of a GPU type, or describe a new one (then all four are needed)."""

    tflops_bf16: float | None = spec(None, "dense BF16 TFLOPS", above(0, 100_000, "TFLOPS"))
    hbm_gb: float | None = spec(None, "HBM capacity", above(0, 10_000, "GB"))
    hbm_tb_per_s: float | None = spec(None, "HBM bandwidth", above(0, 1_000, "TB/s"))
    link_gb_per_s: float | None = spec(None, "GPU link bandwidth per direction", BANDWIDTH)


@dataclass
class PoolConfig:
    """A pool of identical machines."""

    name: str = spec("", "pool name: letters, digits, - and _")
    gpu_type: str = spec("", "a GPU type of the catalog or of hex.gpu_catalog")
    # Up to a 72-GPU NVLink rack counted as one machine.
    gpus_per_machine: int = spec(8, "GPUs in one machine", between(1, 72))
    machines: int | None = spec(
        None,
        "the machine count; or list the hosts (then the count is their number)",
        between(1, MAX_MACHINES),
    )
    hosts: list[str] = spec(help="host names, one per machine", default_factory=list, max_items=MAX_MACHINES)
    # User input: prices differ by provider and contract, so there is no default.
    price_per_gpu_hour: float | None = spec(None, "what one GPU-hour costs you", above(0, 1_000, "$"))
    intra_machine_gb_per_s: float | None = spec(
        None, "GPU-to-GPU bandwidth inside one machine; null takes the catalog's link figure", BANDWIDTH
    )
    inter_machine_gb_per_s: float = spec(
        12.5, "machine-to-machine bandwidth inside the pool (100 GbE = 12.5 GB/s)", BANDWIDTH
    )
    preemptible: bool = spec(
        False,
        "spot or preemptible machines: the planner prices their expected losses (planner/preemption.py)",
    )
    preemptions_per_hour: float | None = spec(
        None,
        "preemptible pools: expected losses per machine-hour (0.05: one per 20 machine-hours)",
        above(0, 60),
    )
    recovery_s: float | None = spec(
        None, "preemptible pools: seconds from a machine's loss until its replacement serves", SECONDS
    )


@dataclass
class LinkConfig:
    """Bandwidth between two pools, overriding ``cluster.cross_pool_gb_per_s`` for that pair."""

    pools: list[str] = spec(help="the two pools this link joins", default_factory=list)
    gb_per_s: float | None = spec(None, "machine-to-machine bandwidth between the two pools", BANDWIDTH)


# Pools of a cluster: a mixed cluster has a handful of GPU types; pools also split a type by site or contract.
MAX_POOLS = 16


@dataclass
class ClusterConfig:
    pools: list[PoolConfig] = spec(
        help="pools of identical machines", default_factory=list, max_items=MAX_POOLS
    )
    cross_pool_gb_per_s: float = spec(
        1.5,
        "default machine-to-machine bandwidth between different pools (the paper's H800<->H20)",
        BANDWIDTH,
    )
    links: list[LinkConfig] = spec(
        help="pair overrides of the cross-pool bandwidth", default_factory=list, max_items=MAX_POOLS**2
    )


LENGTH_KINDS = ("lognormal", "file")


@dataclass
class OutputLengthConfig:
    """Distribution of generated tokens per sample.

    ``lognormal``: a long tail with the given mean and log-space sigma, truncated at ``gconfig.max_new_tokens``.
    ``file``: profiled lengths, one integer per line (or a JSON list), at ``path``.
    """

    kind: str = spec("lognormal", "output-length distribution", choices=LENGTH_KINDS)
    mean_tokens: float | None = spec(None, "mean generated tokens per sample", above(0, 10_000_000, "tokens"))
    sigma: float = spec(0.8, "log-space sigma; typical long-CoT tails: 0.5 to 1.2", above(0, 3))
    cap_share: float = spec(
        0.0, "share of samples that stop at gconfig.max_new_tokens (truncated; lognormal)", between(0, 0.5)
    )
    path: str | None = spec(None, "file of profiled lengths (kind: file)")


@dataclass
class WorkloadConfig:
    model: str | None = spec(
        None, "a built-in model name or a local HF model directory / config.json; null takes actor.path"
    )
    prompt_tokens: int | None = spec(
        None,
        "mean prompt length; null takes half of train_dataset.max_length (or 512)",
        between(1, 10_000_000, "tokens"),
    )
    output_lengths: OutputLengthConfig = field(default_factory=OutputLengthConfig)
    reward_cpu_s_per_sample: float = spec(
        0.0, "reward CPU-seconds per sample (rule-based math: about 0)", between(0, 86_400, "s")
    )
    reward_cpus: int = spec(16, "CPU cores scoring rewards", between(1, 65_536))


# How a plan is picked from the cost vs tokens/s frontier (hex.objective.pick).
PICKS = ("cheapest_within_interval", "fastest", "knee")


@dataclass
class ObjectiveConfig:
    """What to optimise. Neither set: max tokens/s on the whole inventory."""

    budget_per_hour: float | None = spec(
        None, "max tokens/s under this $/h, choosing which machines to use", above(0, 10_000_000, "$/h")
    )
    target_tokens_per_s: float | None = spec(
        None, "min $/h reaching this tokens/s", above(0, 1e10, "tokens/s")
    )
    pick: str = spec(
        "cheapest_within_interval",
        "with a budget or none: cheapest_within_interval (the budget is a ceiling: the cheapest plan within "
        "max(2%, the fit's residual spread) of the fastest, then any within 2% of its tokens/s it costs 5% above; "
        "planner/interval.py), "
        "fastest (spend it all: the most tokens/s, the cheapest within 0.1% of it) or knee (the knee of the cost "
        "vs tokens/s frontier within the budget: the fastest plan within 2% of the lowest $ per token)",
        choices=PICKS,
    )
    throughput_tolerance: float = spec(
        0.0,
        "with pick=fastest or cheapest_within_interval: the cheapest plan within this share of the fastest's "
        "tokens/s (0.02: within 2%; with cheapest_within_interval, where wider than the interval)",
        between(0, 0.5),
    )


@dataclass
class SolverConfig:
    time_limit_s: float = spec(
        60.0,
        "work limit of the whole search, in about CPU seconds of a 2020s core (counted work, not time: any "
        "machine, fast, slow or busy, gets the same plan)",
        SECONDS,
    )
    num_workers: int = spec(
        1, "CP-SAT search workers (1: the same plan on every run; more race and may not)", between(1, 256)
    )
    # CP-SAT's random_seed is a 32-bit integer.
    seed: int = spec(0, "CP-SAT random seed", between(0, 2**31 - 1))
    stable_iterations: int = spec(
        20,
        "stop the repartition loop once max(C_T, C_I) is stable this many iterations (K)",
        between(1, 1_000),
    )
    max_pp_stages: int | None = spec(
        None,
        "most pipeline stages of a training layout or a rollout replica; null: as deep as the model allows (one "
        "decoder layer per stage); the search tries every depth up to 4, then 6, 8, 12, 16, 24, ... and the bound",
        between(1, 1024),
    )
    max_update_window: int = spec(
        0,
        "most training steps per weight update of the rollout servers (delta); 0: as many as the staleness bound "
        "allows (rollout.max_head_offpolicyness + 1); 1: every step, as upstream AReaL",
        between(0, 1_000),
    )
    rollout_layout: list[int] = spec(
        help="[tp, pp]: every rollout replica uses this layout; empty: free",
        range=between(1, 72),
        default_factory=list,
    )
    train_on_preemptible: bool = spec(
        False,
        "let training use preemptible pools (needs recover checkpoints: recover.mode and recover.freq_steps or "
        "freq_secs); false keeps training on reliable pools",
    )


@dataclass
class GpuEfficiencyConfig:
    """Calibration factors of one GPU type (fractions in (0, 1], GB/s, seconds); unset ones keep the profile's or
    the default."""

    train_mfu: float | None = spec(None, "training model FLOPs utilisation", above(0, 1))
    infer_mfu: float | None = spec(None, "fraction of peak FLOPS of compute-bound inference", above(0, 1))
    hbm_fraction: float | None = spec(None, "fraction of the HBM bandwidth decode sustains", above(0, 1))
    link_efficiency: float | None = spec(None, "fraction of the GPU link NCCL achieves", above(0, 1))
    update_gb_per_s: float | None = spec(None, "GB/s a GPU gathers or loads a weight version", above(0, 1000))
    update_fixed_s: float | None = spec(None, "fixed seconds per weight update", between(0, 600))
    decode_overhead_s: float | None = spec(
        None, "seconds per decode iteration outside the kernels", between(1e-4, 5e-3, "s")
    )


@dataclass
class CalibrationConfig:
    """Cost-model efficiency factors: defaults, then a profile JSON (``areal-hex profile``), then these."""

    profile: str | None = spec(None, "a profile JSON written by areal-hex profile")
    gpu_types: dict[str, GpuEfficiencyConfig] = field(default_factory=dict)
    # 5: the replay (simulate --truth) recovers the same gap refitting every 2, 5 or 10 steps; 5 bounds the wait.
    refit_every: int = spec(
        5,
        "the live run refits the factors of its GPU types from its own measurements every this many steps, "
        "writes hex_profile.json beside its plan and decides whether to re-plan (areal/refit_loop.py); 0: off",
        between(0, 1 << 20),
    )
    # planner/refit_replan.py's THRESHOLD: the replay's largest gain without a real gap (0.4%) plus the model's
    # runtime error there (2.1%).
    replan_threshold: float = spec(
        0.03,
        "suggest a re-plan (or, with hex.elastic.auto_replan, re-share) when the refit model's answer beats the "
        "running one by more than this fraction, or by more than the refit's own uncertainty where its steps "
        "scatter more (hex/replan/threshold)",
        above(0, 10),
    )


ROUTING_POLICIES = ("shares", "least_outstanding")
TRANSPORTS = ("relay", "upstream")
# The relay transport's choices; areal_hex_plugin.transport checks against these same tuples.
RELAY_BACKENDS = ("tcp", "gloo", "nccl")
RELAY_ON_FAILURE = ("reroute", "fail")


@dataclass
class RelayConfig:
    """Options of the relay weight transport (used when ``transport: relay``)."""

    backend: str = spec(
        "tcp",
        "payload link: tcp (works anywhere), gloo (the same authenticated TCP path), or nccl (CUDA on both ends)",
        choices=RELAY_BACKENDS,
    )
    timeout_s: float = spec(
        30.0, "a replica silent this long, or a link that stops moving, counts as dead", SECONDS
    )
    chunk_mb: int = spec(4, "payload chunk each replica forwards down its chain", between(1, 1024, "MiB"))
    on_failure: str = spec(
        "reroute", "when a replica dies: reroute around it, or fail the update", choices=RELAY_ON_FAILURE
    )
    max_resends: int = spec(
        3,
        "re-sends of a corrupted bucket before that replica counts as dead; 0 never re-sends",
        between(0, 100),
    )
    min_committed_fraction: float = spec(
        1.0, "the update fails when fewer replicas than this fraction committed", above(0, 1)
    )
    allowed_hosts: list[str] = spec(
        help="peer addresses a receiver accepts; empty: any peer proving AREAL_HEX_TRANSPORT_TOKEN",
        default_factory=list,
        max_items=65_536,
    )
    bind_interface: str | None = spec(
        None, "interface the receivers listen on (e.g. ib0); null: the worker's own address"
    )
    stage_dir: str = spec(
        "/dev/shm",
        "node-local directory a verified version is written to for SGLang to load (in a private "
        "areal-hex-uid<uid> directory the node makes there)",
    )
    rollback_dir: str | None = spec(
        "/var/tmp",
        "node-local disk directory a loaded version moves to (what a failed load rolls back to; in a private "
        "areal-hex-uid<uid> directory the node makes there); null: it stays in stage_dir",
    )


def check_relay_sender(
    backend: str, on_failure: str, timeout_s: float, chunk_bytes: float, max_resends: int
) -> None:
    """Refuse sender options no relay can run with, naming the ``hex.relay`` field (the recipe reader and the
    transport's SenderConfig both call this), by :class:`RelayConfig`'s own metadata."""
    scalar(str, backend, "hex.relay.backend", meta_of(RelayConfig, "backend"))
    scalar(str, on_failure, "hex.relay.on_failure", meta_of(RelayConfig, "on_failure"))
    scalar(float, timeout_s, "hex.relay.timeout_s", meta_of(RelayConfig, "timeout_s"))
    # The recipe gives whole MiB (checked by its range); the transport's tests use smaller chunks.
    limit = meta_of(RelayConfig, "chunk_mb")["range"].high * 2**20
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int | float)
        or not 0 < chunk_bytes <= limit
    ):
        raise HexError(
            "hex.relay.chunk_mb",
            f"must be in (0, {limit / 2**20:g}] MiB, got {chunk_bytes!r} bytes",
            "e.g. 4 (MiB)",
        )
    scalar(int, max_resends, "hex.relay.max_resends", meta_of(RelayConfig, "max_resends"))


@dataclass
class ElasticConfig:
    """How a run copes with rollout servers that come and go and with output lengths that drift
    (``areal/elastic/``). A lost server is noticed within ``failures_to_down * (health_interval_s +
    health_timeout_s)`` seconds (sooner when one of its requests fails)."""

    enabled: bool = spec(
        True, "watch the rollout servers, resubmit a lost server's samples, re-solve the shares"
    )
    health_interval_s: float = spec(
        1.0, "seconds between two health probes of a rollout server", above(0, 3600, "s")
    )
    health_timeout_s: float = spec(2.0, "a health probe unanswered this long fails", above(0, 3600, "s"))
    failures_to_down: int = spec(
        2, "consecutive failed probes after which a server counts as lost", between(1, 100)
    )
    relaunch: bool = spec(
        True,
        "relaunch a lost server on its machine while its worker answers; it rejoins the routing once it holds the "
        "trainer's current version (needs hex.transport=relay)",
    )
    drift_threshold: float = spec(
        0.2,
        "re-balance the shares when the served output lengths move the predicted rollout time by more than this "
        "fraction",
        above(0, 100),
    )
    drift_min_samples: int = spec(
        8, "samples a step must serve before its lengths are compared", between(1, 1 << 30)
    )
    auto_replan: bool = spec(
        False,
        "apply the online refit's rollout shares live (re-solved under the refit model; only where they generate "
        "more than hex.calibration.replan_threshold faster than the shares held), and a re-plan that moves "
        "machines between roles or layouts: live where it leaves training as it is (live_relayout), else at the "
        "next recover checkpoint: the run saves it, stops and goes on from it on the new plan (needs recover.mode "
        "on or auto); at most max_auto_replans times",
    )
    max_auto_replans: int = spec(
        1,
        "with auto_replan: the re-plans a run (one trial, restarts included) applies on its own, live or by "
        "restarting from the recover checkpoint; past it, role and layout changes are only suggested; 0: never",
        between(0, 100),
    )
    live_relayout: bool = spec(
        True,
        "with auto_replan: a re-plan that only starts, stops or re-lays out rollout servers is applied live, one "
        "machine at a time (needs scheduler.type=hex_local and hex.transport=relay); false: at the next recover "
        "checkpoint",
    )
    min_rollout_capacity: float = spec(
        0.5,
        "a live re-layout takes a machine out only while the servers left serve at least this fraction of the "
        "rollout capacity (predicted tokens/s) the run had when it began",
        between(0, 1),
    )
    relayout_wait_s: float = spec(
        600.0,
        "the longest a live re-layout waits for a machine to drain, or for the servers started before it to serve "
        "(they serve from the trainer's next weight update)",
        above(0, 86400, "s"),
    )


@dataclass
class HexConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gpu_catalog: dict[str, GpuTypeConfig] = field(default_factory=dict)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    transport: str = spec(
        "relay",
        "weight transport between GPU types: relay (ours) or upstream (xccl/disk)",
        choices=TRANSPORTS,
    )
    relay: RelayConfig = field(default_factory=RelayConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    routing: str = spec(
        "shares",
        "how the rollout controller picks a server: shares (weighted round-robin by the plan's shares) or "
        "least_outstanding (fewest requests in flight per unit of share)",
        choices=ROUTING_POLICIES,
    )
    plan_path: str | None = spec(None, "load this saved plan instead of solving at start")
    dry_run: bool = spec(False, "print the rewritten upstream config and the placement, then exit")
    plan_out: str | None = spec(
        None, "write the plan the driver runs (HexPlan JSON) here, before anything starts"
    )
    workflow: str = spec(
        "areal.workflow.openai.math_agent.MathAgent",
        "the rollout workflow: import path of a RolloutWorkflow or agent class; the driver builds it with the "
        "gconfig's temperature, top_p, max_tokens and max_completion_tokens, as upstream's examples do",
    )
    reward_fn: str | None = spec(
        None,
        "for a RolloutWorkflow such as areal.workflow.rlvr.RLVRWorkflow: the import path of its reward function "
        "(e.g. areal.reward.gsm8k.gsm8k_reward_fn); the driver then builds the workflow with reward_fn, the gconfig "
        "and the tokenizer path, as upstream's RLVR examples do",
    )
