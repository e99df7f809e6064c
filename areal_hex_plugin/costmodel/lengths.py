"""What the output-length distribution implies for a continuously batched rollout replica."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

from areal_hex_plugin.specs.workload import LengthDistribution

DRAIN_POINTS = 24


@dataclass(frozen=True)
class DrainCurve:
    """Share of a full batch still decoding ``t`` steps after admission stops, on a grid.

    ``steps`` are (step count of the interval, surviving share at its midpoint, steps since admission stopped).
    """

    steps: tuple[tuple[float, float, float], ...]

    @property
    def tokens_per_slot(self) -> float:
        """Tokens one batch slot still generates during the drain."""
        return sum(dt * share for dt, share, _ in self.steps)


@dataclass(frozen=True)
class LengthStats:
    mean: float
    # Mean decode position of the sequences in flight when the batch is kept full: sequences are seen in
    # proportion to their length, at a uniform point of it (E[n^2] / 2E[n]).
    inflight_position: float
    drain_from_full: DrainCurve  # admission stops with the batch in its steady mix (residual lengths)
    drain_from_start: DrainCurve  # every slot starts together (a synchronous batch)


def _curve(lengths: tuple[int, ...], residual: bool) -> DrainCurve:
    """Survival on a geometric grid: P(n > t) or, for residuals of a steady batch, E[(n - t)+] / E[n]."""
    suffix = list(accumulate(reversed(lengths)))[::-1] + [0]
    count, mean = len(lengths), sum(lengths) / len(lengths)

    def survival(t: float) -> float:
        i = bisect.bisect_right(lengths, t)
        if not residual:
            return (count - i) / count
        return (suffix[i] - (count - i) * t) / count / mean

    top = float(lengths[-1])
    grid = [0.0] + [top * (2.0 ** (k - DRAIN_POINTS + 1)) for k in range(DRAIN_POINTS)]
    steps = []
    for lo, hi in zip(grid, grid[1:], strict=False):
        mid = (lo + hi) / 2
        steps.append((hi - lo, survival(mid), mid))
    return DrainCurve(tuple(steps))


def length_stats(dist: LengthDistribution) -> LengthStats:
    return LengthStats(
        mean=dist.mean,
        inflight_position=dist.mean_square / (2 * dist.mean),
        drain_from_full=_curve(dist.lengths, residual=True),
        drain_from_start=_curve(dist.lengths, residual=False),
    )
