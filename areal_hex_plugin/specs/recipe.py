"""Read a recipe (an upstream AReaL GRPO YAML plus a ``hex:`` section) without importing areal."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from areal_hex_plugin.costmodel.calibration import Calibration, build_calibration
from areal_hex_plugin.costmodel.memory import TRAIN_BYTES_PER_PARAM, USABLE_HBM_FRACTION, min_rollout_gpus
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs import typed
from areal_hex_plugin.specs.catalog import GpuCatalog, build_catalog
from areal_hex_plugin.specs.cluster import SHARED_MACHINES, Cluster, build_cluster
from areal_hex_plugin.specs.config import HexConfig, RelayConfig, SolverConfig, check_relay_sender
from areal_hex_plugin.specs.files import check_depth
from areal_hex_plugin.specs.models import resolve_model
from areal_hex_plugin.specs.overrides import apply_overrides
from areal_hex_plugin.specs.typed import above, between
from areal_hex_plugin.specs.workload import RLSettings, WorkloadSpec, build_lengths

# Upstream's recover.mode values (RecoverConfig.__post_init__); on and auto write recover checkpoints.
RECOVER_MODES = ("on", "off", "auto", "disabled")
# The upstream fields the planner reads: type, upstream AReaL 1.0.4's default (a test checks them against
# areal.api.cli_args), and the field's help and sane range, checked where the recipe enters like the hex: fields.
UPSTREAM_FIELDS: dict[str, tuple[type, Any, dict[str, Any]]] = {
    "actor.path": (str, "", {"help": "the model: a local HF directory or a known model name"}),
    "train_dataset.batch_size": (int, 1, {"help": "prompts per step", "range": between(1, 65_536)}),
    "train_dataset.max_length": (
        int,
        None,
        {"help": "longest prompt in tokens", "range": between(1, 10_000_000, "tokens")},
    ),
    "gconfig.n_samples": (int, 1, {"help": "responses per prompt", "range": between(1, 1_024)}),
    "gconfig.max_new_tokens": (
        int,
        16384,
        {"help": "longest response in tokens", "range": between(1, 10_000_000, "tokens")},
    ),
    "rollout.max_head_offpolicyness": (
        int,
        0,
        {
            "help": "the staleness bound η: 0 is on-policy; small bounds such as 4 (code) or 8 (math)",
            "range": between(0, 1_000),
        },
    ),
    "rollout.max_concurrent_rollouts": (
        int,
        None,
        {"help": "rollouts in flight; null takes the consumer batch size", "range": between(1, 10_000_000)},
    ),
    "rollout.consumer_batch_size": (
        int,
        1,
        {"help": "prompts per training batch", "range": between(1, 65_536)},
    ),
    "actor.ppo_n_minibatches": (int, 4, {"help": "PPO minibatches per step", "range": between(1, 4_096)}),
    "actor.recompute_logprob": (bool, False, {}),
    "actor.use_decoupled_loss": (bool, False, {}),
    "actor.kl_ctl": (float, 0.1, {"help": "KL penalty coefficient", "range": between(0, 1_000_000)}),
    "actor.gradient_checkpointing": (bool, False, {}),
    "actor.mb_spec.max_tokens_per_mb": (
        int,
        None,
        {"help": "most tokens in one training micro-batch", "range": between(1, 100_000_000, "tokens")},
    ),
    "recover.mode": (
        str,
        "disabled",
        {"help": "upstream's recovery: on/auto write and resume checkpoints", "choices": RECOVER_MODES},
    ),
    "recover.freq_steps": (
        int,
        None,
        {"help": "steps between two recover checkpoints", "range": between(1, 10_000_000)},
    ),
    "recover.freq_secs": (
        int,
        None,
        {"help": "seconds between two recover checkpoints", "range": between(1, 10_000_000, "s")},
    ),
    "sglang.mem_fraction_static": (
        float,
        0.9,
        {"help": "share of GPU memory SGLang keeps for weights and KV cache", "range": above(0, 0.99)},
    ),
}
# Samples a step generates (batch_size x n_samples): beyond about a million no step of a real run goes, and
# the simulator plays every sample.
MAX_SAMPLES_PER_STEP = 1 << 20


@dataclass(frozen=True)
class Recipe:
    path: Path
    config: dict  # the whole recipe after overrides and interpolation (plain containers)
    hex: HexConfig
    upstream: dict[str, Any]  # UPSTREAM_FIELDS values
    catalog: GpuCatalog
    cluster: Cluster
    workload: WorkloadSpec
    calibration: Calibration  # built once, relative profile paths read from the recipe's folder

    @property
    def solver(self) -> SolverConfig:
        """``hex.solver`` with ``max_pp_stages`` resolved: as set (at most the model's decoder layers), or, unset,
        as deep as the model allows (a stage holds at least one layer). What the planner reads."""
        layers = self.workload.model.layers
        return replace(self.hex.solver, max_pp_stages=min(self.hex.solver.max_pp_stages or layers, layers))


def read_yaml(path: str | Path, what: str = "recipe") -> dict:
    """A YAML mapping from ``path``, with one clear error for every way a file can be unusable."""
    file = Path(path).expanduser()
    if not file.exists():
        raise HexError(what, f"no file at {file}", "check the path (recipes live under recipes/)")
    if file.is_dir():
        raise HexError(what, f"{file} is a directory", "give the path of a .yaml file inside it")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise HexError(what, f"cannot read {file}: {exc.strerror}", "check the file's permissions") from None
    if not data.strip():
        raise HexError(what, f"{file} is empty", "start from a shipped recipe under recipes/")
    if b"\x00" in data:
        raise HexError(what, f"{file} is a binary file, not YAML", "give the recipe's .yaml file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise HexError(what, f"{file} is not UTF-8 text", "save the recipe as UTF-8 YAML") from None
    try:
        loaded = yaml.safe_load(text)
    except RecursionError:
        raise HexError(
            what, f"{file} is nested too deeply", "write a flat recipe like recipes/paper/7b.yaml"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise HexError(
            what, f"YAML syntax error in {file}{where}: {problem}", "fix the YAML at that spot"
        ) from None
    if not isinstance(loaded, dict):
        raise HexError(
            what, f"{file} holds a {type(loaded).__name__}, not a mapping", "write 'key: value' lines"
        )
    check_depth(loaded, what, "write a flat recipe like recipes/paper/7b.yaml")
    return loaded


def _upstream_values(config: dict) -> dict[str, Any]:
    cfg = OmegaConf.create(config)
    values: dict[str, Any] = {}
    for key, (kind, default, meta) in UPSTREAM_FIELDS.items():
        value = OmegaConf.select(cfg, key, default=default)
        values[key] = None if value is None else typed.scalar(kind, value, key, meta)
    return values


def _rl_settings(up: dict[str, Any], config: dict, max_update_window: int) -> RLSettings:
    samples = up["train_dataset.batch_size"] * up["gconfig.n_samples"]
    if samples > MAX_SAMPLES_PER_STEP:
        raise HexError(
            "train_dataset.batch_size",
            f"x gconfig.n_samples is {samples:,} samples per step, more than {MAX_SAMPLES_PER_STEP:,}",
            "lower train_dataset.batch_size or gconfig.n_samples",
        )
    eta = up["rollout.max_head_offpolicyness"]
    mcr = up["rollout.max_concurrent_rollouts"]
    ref = config.get("ref") is not None
    return RLSettings(
        batch_size=up["train_dataset.batch_size"],
        n_samples=up["gconfig.n_samples"],
        max_new_tokens=up["gconfig.max_new_tokens"],
        max_head_offpolicyness=eta,
        max_concurrent_rollouts=mcr,
        consumer_batch_size=up["rollout.consumer_batch_size"],
        ppo_n_minibatches=up["actor.ppo_n_minibatches"],
        recompute_logprob=up["actor.recompute_logprob"],
        use_decoupled_loss=up["actor.use_decoupled_loss"],
        ref_model=ref and up["actor.kl_ctl"] > 0,
        gradient_checkpointing=up["actor.gradient_checkpointing"],
        max_tokens_per_mb=up["actor.mb_spec.max_tokens_per_mb"],
        mem_fraction_static=up["sglang.mem_fraction_static"],
        max_update_window=max_update_window,
        megatron=str((config.get("actor") or {}).get("backend", "")).split(":", 1)[0].strip() == "megatron",
    )


def _check_relay(relay: RelayConfig) -> None:
    check_relay_sender(
        relay.backend, relay.on_failure, relay.timeout_s, relay.chunk_mb * 2**20, relay.max_resends
    )
    for i, host in enumerate(relay.allowed_hosts):
        if not host.strip():
            raise HexError(
                f"hex.relay.allowed_hosts[{i}]", "is empty", "give a peer's IP address or host name"
            )
    name = relay.bind_interface
    # Linux interface names are at most 15 characters, without spaces or slashes.
    if name is not None and (not name or len(name) > 15 or any(c.isspace() or c == "/" for c in name)):
        raise HexError(
            "hex.relay.bind_interface",
            f"{name!r} is not a network interface name",
            "give a name such as ib0 or eth0 (see `ip -br addr` on a rollout machine), or null",
        )
    for name, value, example in (
        ("stage_dir", relay.stage_dir, "/dev/shm"),
        ("rollback_dir", relay.rollback_dir, "/var/tmp, or null"),
    ):
        if value is not None and not value.startswith("/"):
            raise HexError(
                f"hex.relay.{name}",
                f"must be an absolute path on the rollout machines, got {value!r}",
                f"e.g. {example}",
            )


def _check_knobs(hex_cfg: HexConfig) -> None:
    """What the fields' own ranges and choices cannot say (``typed.build`` checked those)."""
    _check_relay(hex_cfg.relay)
    layout = hex_cfg.solver.rollout_layout
    if layout and len(layout) != 2:
        raise HexError(
            "hex.solver.rollout_layout",
            f"must be [tp, pp] with both >= 1, got {layout}",
            "e.g. [2, 1], or []",
        )
    elastic, refit_every = hex_cfg.elastic, hex_cfg.calibration.refit_every
    if elastic.auto_replan and (not elastic.enabled or refit_every == 0):
        off = "hex.elastic.enabled is false" if not elastic.enabled else "hex.calibration.refit_every is 0"
        raise HexError(
            "hex.elastic.auto_replan",
            f"applies the online refit's shares through the elastic run, but {off}",
            "set hex.elastic.enabled: true and hex.calibration.refit_every >= 1, or auto_replan: false",
        )
    obj = hex_cfg.objective
    if obj.budget_per_hour is not None and obj.target_tokens_per_s is not None:
        raise HexError(
            "hex.objective",
            "sets both budget_per_hour and target_tokens_per_s",
            "set budget_per_hour to maximise throughput under a budget, or target_tokens_per_s to minimise cost",
        )


def cheapest_deployment(cluster: Cluster, workload: WorkloadSpec) -> tuple[float, str] | None:
    """A lower bound on the $/h of any plan, with the machines that reach it; None when no plan can fit.

    A plan needs training machines whose GPUs together hold the sharded training state (whatever the layout:
    every layout shards or replicates all of it, pipelines over several GPU types included) and rollout machines
    of one pool holding a replica's weights (:func:`min_rollout_gpus`). Activations and the KV cache are not
    counted, so the cheapest plan the planner finds may cost more (it says so when a budget is too low)."""
    model = workload.model
    state = model.params * TRAIN_BYTES_PER_PARAM
    best: tuple[float, str] | None = None
    for rp in cluster.pools:
        r_machines = math.ceil(
            min_rollout_gpus(model, rp.gpu, workload.rl.mem_fraction_static) / rp.gpus_per_machine
        )
        if r_machines > rp.machines:
            continue
        left = {p.name: p.machines - (r_machines if p is rp else 0) for p in cluster.pools}
        trainer = _cheapest_trainer(cluster, left, state)
        if trainer is None:
            continue
        cost = trainer[0] + r_machines * rp.price_per_machine_hour
        if best is None or cost < best[0]:
            shown = " + ".join(f"{n} {name}" for name, n in trainer[1].items())
            best = (cost, f"{shown} machine(s) training + {r_machines} {rp.name} machine(s) generating")
    shared = _cheapest_shared(cluster, workload, state)
    return shared if shared is not None and (best is None or shared[0] < best[0]) else best


def _cheapest_shared(cluster: Cluster, workload: WorkloadSpec, state: float) -> tuple[float, str] | None:
    """The least a plan costs with one machine split between a rollout replica and training (small inventories
    only, as the planner splits machines: ``SHARED_MACHINES``)."""
    if sum(p.machines for p in cluster.pools) > SHARED_MACHINES:
        return None
    best: tuple[float, str] | None = None
    for rp in cluster.pools:
        replica = min_rollout_gpus(workload.model, rp.gpu, workload.rl.mem_fraction_static)
        if rp.gpus_per_machine < 2 or replica >= rp.gpus_per_machine:
            continue
        room = USABLE_HBM_FRACTION * rp.gpu.hbm_bytes * (rp.gpus_per_machine - replica)
        left = {p.name: p.machines - (1 if p is rp else 0) for p in cluster.pools}
        trainer = (0.0, {}) if room >= state else _cheapest_trainer(cluster, left, state - room)
        if trainer is None:
            continue
        cost = trainer[0] + rp.price_per_machine_hour
        if best is None or cost < best[0]:
            more = "".join(f" + {n} {name} machine(s) training" for name, n in trainer[1].items())
            best = (cost, f"one {rp.name} machine split between training and a rollout replica{more}")
    return best


def _cheapest_trainer(
    cluster: Cluster, machines: dict[str, int], state_bytes: float
) -> tuple[float, dict[str, int]] | None:
    """The cheapest machines (at most ``machines`` per pool) whose usable memory holds ``state_bytes``: exact, a
    depth-first search over pools by price per byte, cut where even the cheapest bytes left cannot beat the best."""
    pools = sorted(
        (p for p in cluster.pools if machines[p.name] > 0),
        key=lambda p: p.price_per_machine_hour / p.gpu.hbm_bytes / p.gpus_per_machine,
    )
    room = [USABLE_HBM_FRACTION * p.gpu.hbm_bytes * p.gpus_per_machine for p in pools]
    best: list = [math.inf, {}]

    def go(i: int, need: float, cost: float, chosen: dict[str, int]) -> None:
        if need <= 0:
            if cost < best[0]:
                best[:] = [cost, dict(chosen)]
            return
        if i == len(pools) or cost + need * pools[i].price_per_machine_hour / room[i] >= best[0]:
            return
        for n in range(min(machines[pools[i].name], math.ceil(need / room[i])), -1, -1):
            go(
                i + 1,
                need - n * room[i],
                cost + n * pools[i].price_per_machine_hour,
                {**chosen, pools[i].name: n} if n else chosen,
            )

    go(0, state_bytes, 0.0, {})
    return (best[0], best[1]) if math.isfinite(best[0]) else None


def load_recipe(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), base_dir: str | Path | None = None
) -> Recipe:
    """Load and validate a recipe; every problem raises :class:`HexError` naming the field. Relative paths in
    it are read from ``base_dir`` (default: the recipe's folder)."""
    file = Path(path).expanduser()
    folder = Path(base_dir) if base_dir is not None else file.parent
    return build_recipe(apply_overrides(read_yaml(file), list(overrides)), file, folder)


def build_recipe(config: dict, file: Path, folder: Path) -> Recipe:
    """The recipe whose whole config (overrides applied, plain containers) is ``config``, read from ``file``;
    relative paths in it are read from ``folder``."""
    if "hex" not in config:
        raise HexError(
            "hex",
            "the recipe has no hex: section",
            "add one describing the cluster (see recipes/paper/7b.yaml)",
        )
    hex_cfg: HexConfig = typed.build(HexConfig, config["hex"], "hex")
    _check_knobs(hex_cfg)
    upstream = _upstream_values(config)
    rl = _rl_settings(upstream, config, hex_cfg.solver.max_update_window)
    catalog = build_catalog({name: vars(fig) for name, fig in hex_cfg.gpu_catalog.items()})
    cluster = build_cluster(hex_cfg.cluster, catalog)
    calibration = build_calibration(hex_cfg.calibration, catalog, folder)

    model_spec = hex_cfg.workload.model or upstream["actor.path"]
    if not model_spec:
        raise HexError("hex.workload.model", "no model given", "set actor.path or hex.workload.model")
    model_field = "hex.workload.model" if hex_cfg.workload.model else "actor.path"
    model = resolve_model(model_spec, model_field)
    max_prompt = upstream["train_dataset.max_length"]
    prompt_tokens = hex_cfg.workload.prompt_tokens or (max(1, max_prompt // 2) if max_prompt else 512)
    lengths = build_lengths(
        hex_cfg.workload.output_lengths, rl.max_new_tokens, folder, "hex.workload.output_lengths"
    )
    workload = WorkloadSpec(
        model=model,
        rl=rl,
        prompt_tokens=prompt_tokens,
        output_lengths=lengths,
        reward_cpu_s_per_sample=hex_cfg.workload.reward_cpu_s_per_sample,
        reward_cpus=hex_cfg.workload.reward_cpus,
    )
    cheapest = cheapest_deployment(cluster, workload)
    if cheapest is None:
        raise HexError(
            model_field,
            f"{model.name} ({model.params / 1e9:.1f}B parameters) fits no split of this cluster into a trainer "
            "and a rollout replica",
            "add machines or GPUs with more memory, or choose a smaller model",
        )
    budget = hex_cfg.objective.budget_per_hour
    if budget is not None and budget < cheapest[0]:
        raise HexError(
            "hex.objective.budget_per_hour",
            f"${budget:g}/h is below ${cheapest[0]:.2f}/h, the least any plan costs ({cheapest[1]}: the "
            "training state and a replica's weights alone need that much memory)",
            f"raise the budget to at least {cheapest[0]:.2f}, or add cheaper machines",
        )
    return Recipe(file, config, hex_cfg, upstream, catalog, cluster, workload, calibration)
