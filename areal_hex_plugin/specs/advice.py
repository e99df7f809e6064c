"""What a loaded recipe leaves to chance: legal but suspicious settings (warnings, each with its fix) and the
defaults that change the result (said out loud, so nobody plans on a figure they never chose)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_hex_plugin.specs.recipe import Recipe

FEW_SAMPLES = 64  # samples per step below which a GRPO step is too small to plan for
TRUNCATION = 0.5  # a mean output this close to max_new_tokens truncates many samples


@dataclass(frozen=True)
class Note:
    kind: str  # "warning" | "default"
    field: str
    text: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.field}: {self.text}" + (f"\n  fix: {self.fix}" if self.fix else "")


def _given(config: dict, key: str) -> bool:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _warnings(recipe: Recipe) -> list[Note]:
    rl, config = recipe.workload.rl, recipe.config
    notes = []
    samples = rl.batch_size * rl.n_samples
    if samples < FEW_SAMPLES:
        unset = [k for k in ("train_dataset.batch_size", "gconfig.n_samples") if not _given(config, k)]
        why = f" ({', '.join(unset)} not set: upstream's default)" if unset else ""
        notes.append(
            Note(
                "warning",
                "train_dataset.batch_size x gconfig.n_samples",
                f"each step is {rl.batch_size} prompt(s) x {rl.n_samples} sample(s) = {samples} sequences{why}",
                "plan the step you will train, e.g. train_dataset.batch_size=64 gconfig.n_samples=16 (the paper's)",
            )
        )
    if rl.n_samples == 1:
        notes.append(
            Note(
                "warning",
                "gconfig.n_samples",
                "is 1: GRPO's group-relative advantage is 0 for a group of one, so nothing is learned",
                "generate several samples per prompt, e.g. gconfig.n_samples=8",
            )
        )
    if rl.max_head_offpolicyness == 0:
        notes.append(
            Note(
                "warning",
                "rollout.max_head_offpolicyness",
                "is 0: every step waits for its own rollouts, so generation and training never overlap",
                "allow a little staleness, e.g. rollout.max_head_offpolicyness=4 (the paper: 4 for code, 8 for math)",
            )
        )
    mean = recipe.workload.output_lengths.mean
    if mean > TRUNCATION * rl.max_new_tokens:
        notes.append(
            Note(
                "warning",
                "gconfig.max_new_tokens",
                f"is {rl.max_new_tokens:,} and the mean output {mean:,.0f} tokens: many samples are cut off",
                f"raise gconfig.max_new_tokens to {int(3 * mean):,} or more",
            )
        )
    budget = recipe.hex.objective.budget_per_hour
    everything = recipe.cluster.price_per_hour
    if budget is not None and budget > everything:
        notes.append(
            Note(
                "warning",
                "hex.objective.budget_per_hour",
                f"${budget:,.2f}/h is more than the whole inventory costs (${everything:,.2f}/h): it limits nothing",
                "add the machines the budget could rent, or lower the budget",
            )
        )
    return notes


def _defaults(recipe: Recipe) -> list[Note]:
    config, cluster = recipe.config, recipe.cluster
    notes = []
    uncovered = [
        (a.name, b.name)
        for i, a in enumerate(cluster.pools)
        for b in cluster.pools[i + 1 :]
        if tuple(sorted((a.name, b.name))) not in cluster.links
    ]
    if uncovered and not _given(config, "hex.cluster.cross_pool_gb_per_s"):
        pairs = ", ".join(f"{a}-{b}" for a, b in uncovered)
        notes.append(
            Note(
                "default",
                "hex.cluster.cross_pool_gb_per_s",
                f"{cluster.cross_pool_gb_per_s:g} GB/s between machines of different pools ({pairs}): the "
                "paper's H800-H20 figure, not a measurement of this cluster",
                "measure it (e.g. iperf3 between two machines) and set hex.cluster.cross_pool_gb_per_s",
            )
        )
    for i, pool in enumerate(cluster.pools):
        key = f"hex.cluster.pools.{i}.inter_machine_gb_per_s"
        pools = config.get("hex", {}).get("cluster", {}).get("pools", [])
        if pool.machines > 1 and not (i < len(pools) and "inter_machine_gb_per_s" in pools[i]):
            notes.append(
                Note(
                    "default",
                    key,
                    f"{pool.inter_machine_gb_per_s:g} GB/s between {pool.name} machines (100 GbE)",
                    f"set {key} to the machines' measured network bandwidth",
                )
            )
    if not _given(config, "hex.workload.prompt_tokens"):
        source = (
            "half of train_dataset.max_length" if _given(config, "train_dataset.max_length") else "no hint"
        )
        notes.append(
            Note(
                "default",
                "hex.workload.prompt_tokens",
                f"{recipe.workload.prompt_tokens:,} tokens per prompt ({source})",
                "set hex.workload.prompt_tokens to your dataset's mean prompt length",
            )
        )
    cal = recipe.hex.calibration
    if not cal.profile and not cal.gpu_types:
        notes.append(
            Note(
                "default",
                "hex.calibration",
                f"efficiency factors of {', '.join(cluster.gpu_types)} are built-in assumptions "
                "(costmodel/calibration.py), not measured",
                f"measure each type on a machine with it, e.g. areal-hex profile RECIPE --gpu-type "
                f"{cluster.gpu_types[0]} --json {cluster.gpu_types[0]}.json",
            )
        )
    return notes


def recipe_notes(recipe: Recipe) -> list[Note]:
    """Warnings first, then the defaults that shape the result."""
    return _warnings(recipe) + _defaults(recipe)
