"""Workload: the model, the RL settings the planner needs, and the output-length distribution."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.config import OutputLengthConfig
from areal_hex_plugin.specs.models import ModelShape
from areal_hex_plugin.specs.typed import between


@dataclass(frozen=True)
class LengthDistribution:
    """Generated tokens per sample, as a sorted sample of lengths (quantiles are exact on it).

    A parametric distribution is represented by a fixed, deterministic 4,096-point quantile grid so that every
    consumer (cost model, scheduler, simulator) sees the same numbers.
    """

    lengths: tuple[int, ...]
    source: str

    @cached_property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    @cached_property
    def mean_square(self) -> float:
        return sum(n * n for n in self.lengths) / len(self.lengths)

    @property
    def max(self) -> int:
        return self.lengths[-1]

    def quantile(self, q: float) -> int:
        index = min(len(self.lengths) - 1, max(0, math.ceil(q * len(self.lengths)) - 1))
        return self.lengths[index]

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return [self.lengths[rng.randrange(len(self.lengths))] for _ in range(n)]

    @staticmethod
    def lognormal(
        mean: float, sigma: float, cap: int, points: int = 4096, cap_share: float = 0.0
    ) -> LengthDistribution:
        """Lognormal with log-space sigma, capped at ``cap`` tokens, and a point mass of ``cap_share`` at the cap
        (samples the engine truncates). The lognormal part's untruncated mean is set so that the whole has
        about ``mean`` (exactly, when the lognormal part does not reach the cap)."""
        at_cap = round(cap_share * points)
        body = points - at_cap
        body_mean = (mean - cap_share * cap) / (1 - cap_share)
        mu = math.log(body_mean) - sigma * sigma / 2
        dist = _NormalQuantile()
        grid = [min(cap, max(1, round(math.exp(mu + sigma * dist((i + 0.5) / body))))) for i in range(body)]
        share = f", cap_share={cap_share:g}" if at_cap else ""
        return LengthDistribution(
            tuple(sorted(grid)) + (cap,) * at_cap,
            f"lognormal(mean={mean:g}, sigma={sigma:g}, cap={cap}{share})",
        )


class _NormalQuantile:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""

    _a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
          -3.066479806614716e01, 2.506628277459239e00)  # fmt: skip
    _b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
          -1.328068155288572e01)  # fmt: skip
    _c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
          4.374664141464968e00, 2.938163982698783e00)  # fmt: skip
    _d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)

    def __call__(self, p: float) -> float:
        a, b, c, d = self._a, self._b, self._c, self._d
        if p < 0.02425:
            q = math.sqrt(-2 * math.log(p))
            return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
                (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
            )
        if p > 1 - 0.02425:
            return -self(1 - p)
        q = p - 0.5
        r = q * q
        return (
            (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
            * q
            / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
        )


# A lengths file: at most this many samples (a profile of a few batches has thousands), each a whole number of
# tokens in LENGTH_RANGE.
MAX_LENGTH_SAMPLES = 1_000_000
LENGTH_RANGE = between(1, 10_000_000, "tokens")


def read_length_file(path: Path, field_path: str, cap: int) -> LengthDistribution:
    """Profiled lengths: one whole number per line, or one JSON list of whole numbers."""
    try:
        if path.stat().st_size > 64 * MAX_LENGTH_SAMPLES:
            raise HexError(field_path, f"{path} is larger than 64 MB", "keep a sample of the lengths")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise HexError(
            field_path, f"cannot read {path}: {exc}", "point at a text file of output lengths"
        ) from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.split()
    except (ValueError, RecursionError):
        values = None
    if not isinstance(values, list) or not values:
        raise HexError(field_path, f"{path} is not a list of whole numbers", "write one token count per line")
    if len(values) > MAX_LENGTH_SAMPLES:
        raise HexError(
            field_path, f"{path} has {len(values):,} lengths", f"keep at most {MAX_LENGTH_SAMPLES:,} of them"
        )
    lengths = []
    for i, value in enumerate(values):
        if isinstance(value, str) and value.isdigit() and len(value) < 30:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value not in LENGTH_RANGE:
            raise HexError(
                field_path,
                f"{path}: entry {i + 1} ({str(value)[:30]}) is not a whole number of tokens in {LENGTH_RANGE}",
                "write one positive token count per line",
            )
        lengths.append(min(cap, value))
    return LengthDistribution(tuple(sorted(lengths)), f"file {path.name} ({len(lengths)} samples)")


def build_lengths(
    cfg: OutputLengthConfig, max_new_tokens: int, base_dir: Path, path: str
) -> LengthDistribution:
    """The distribution ``cfg`` describes (its numbers were range-checked where the recipe entered)."""
    if cfg.kind == "lognormal":
        if cfg.mean_tokens is None:
            raise HexError(
                f"{path}.mean_tokens",
                "is missing",
                "give the mean generated length in tokens (profile a few batches, or use kind: file)",
            )
        if cfg.mean_tokens > max_new_tokens:
            raise HexError(
                f"{path}.mean_tokens",
                f"{cfg.mean_tokens:g} exceeds gconfig.max_new_tokens={max_new_tokens}",
                "lower the mean or raise gconfig.max_new_tokens",
            )
        if cfg.mean_tokens <= cfg.cap_share * max_new_tokens:
            raise HexError(
                f"{path}.cap_share",
                f"{cfg.cap_share:g} of samples at the cap ({max_new_tokens}) alone exceed the mean "
                f"{cfg.mean_tokens:g}",
                "lower cap_share or raise mean_tokens",
            )
        return LengthDistribution.lognormal(
            cfg.mean_tokens, cfg.sigma, max_new_tokens, cap_share=cfg.cap_share
        )
    if not cfg.path:
        raise HexError(f"{path}.path", "is missing for kind: file", "give the file of profiled lengths")
    file = Path(cfg.path).expanduser()
    return read_length_file(file if file.is_absolute() else base_dir / file, f"{path}.path", max_new_tokens)


@dataclass(frozen=True)
class RLSettings:
    """The upstream GRPO settings the planner needs (read from the recipe's upstream part)."""

    batch_size: int  # prompts per training step (train_dataset.batch_size)
    n_samples: int  # responses per prompt (gconfig.n_samples)
    max_new_tokens: int
    max_head_offpolicyness: int  # η
    max_concurrent_rollouts: int | None
    consumer_batch_size: int
    ppo_n_minibatches: int
    recompute_logprob: bool
    use_decoupled_loss: bool
    ref_model: bool  # a reference model forward pass per step (ref configured and kl_ctl > 0)
    gradient_checkpointing: bool = False  # actor.gradient_checkpointing: one more forward in the backward
    max_tokens_per_mb: int | None = None  # actor.mb_spec.max_tokens_per_mb (None: one micro-batch)
    mem_fraction_static: float = 0.9  # sglang.mem_fraction_static: weights + KV pool share of GPU memory
    max_update_window: int = 0  # hex.solver.max_update_window (0: as the staleness bound allows)
    # Rollouts admission lets in at once whatever the plan would choose (0: no such limit). A measured AReaL run
    # leaves max_concurrent_rollouts unset: upstream then admits consumer_batch_size (sim/baselines.py).
    max_admitted: int = 0
    # Upstream 1.0.4's TrainController deals a step's samples out evenly over the DP ranks, so dp must divide
    # them. False for the paper's measured runs, whose AReaL version and DP layout are not stated.
    even_dispatch: bool = True
    # actor.backend is Megatron: every training layout runs on it, one stage too. Otherwise (FSDP, and the paper's
    # space) one stage runs on FSDP and a pipeline on Megatron (FSDP has no pipeline parallelism).
    megatron: bool = False

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.n_samples

    @property
    def forward_passes(self) -> int:
        """Forward-only passes per step besides the training forward/backward (log-probs, reference)."""
        return int(self.recompute_logprob or self.use_decoupled_loss) + int(self.ref_model)


@dataclass(frozen=True)
class WorkloadSpec:
    model: ModelShape
    rl: RLSettings
    prompt_tokens: int
    output_lengths: LengthDistribution
    reward_cpu_s_per_sample: float
    reward_cpus: int

    def at_eta(self, eta: int) -> WorkloadSpec:
        """This workload under the staleness bound ``eta``."""
        return replace(self, rl=replace(self.rl, max_head_offpolicyness=eta))

    def on_megatron(self, megatron: bool) -> WorkloadSpec:
        """This workload trained by a Megatron actor (every layout), or not (one stage on FSDP)."""
        return replace(self, rl=replace(self.rl, megatron=megatron))

    @property
    def mean_sequence_tokens(self) -> float:
        return self.prompt_tokens + self.output_lengths.mean

    @property
    def tokens_per_step(self) -> float:
        """Tokens (prompt + generated) the trainer consumes per step, on average."""
        return self.rl.samples_per_step * self.mean_sequence_tokens
