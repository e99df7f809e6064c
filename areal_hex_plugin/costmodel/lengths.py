"""What the output-length distribution implies for a continuously batched rollout replica."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate, pairwise

from areal_hex_plugin.specs.workload import LengthDistribution

DRAIN_POINTS = 24


@dataclass(frozen=True)
class DrainCurve:
    """Share of a full batch still decoding ``t`` steps after admission stops, on a grid.

    ``steps`` are (steps in the interval, mean surviving share over it, steps since admission stopped at its
    midpoint).
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
    drain_from_start: DrainCurve  # every slot starts together (a synchronous batch)
    # Expected longest of a rollout's n_samples lengths over the mean length. Upstream's admission counts
    # rollouts, and one holds its slot until its longest sample ends, so keeping k sequences decoding takes
    # k / n_samples * group_hold rollouts admitted.
    group_hold: float = 1.0
    # Expected longest of a step's samples (the cap, once the distribution's point mass there is reached by a
    # step's draws): the step's rollout cannot end before it does.
    step_longest: float = 0.0


def _curve(lengths: tuple[int, ...]) -> DrainCurve:
    """Survival ``P(n > t)`` of a batch whose slots all start together, on a geometric grid, averaged exactly
    over each interval through tail sums of ``(n - t)``."""
    count = len(lengths)
    tail = list(accumulate(reversed(lengths)))[::-1] + [0]

    def beyond(t: float) -> float:
        """Integral of the survival from ``t`` to the end."""
        i = bisect.bisect_right(lengths, t)
        return (tail[i] - (count - i) * t) / count

    top = float(lengths[-1])
    grid = [0.0] + [top * (2.0 ** (k - DRAIN_POINTS + 1)) for k in range(DRAIN_POINTS)]
    steps = []
    for lo, hi in pairwise(grid):
        steps.append((hi - lo, (beyond(lo) - beyond(hi)) / (hi - lo), (lo + hi) / 2))
    return DrainCurve(tuple(steps))


def expected_longest(lengths: tuple[int, ...], n: int) -> float:
    """Exact expected maximum of ``n`` independent draws from the sorted sample ``lengths``."""
    count = len(lengths)
    return sum(length * ((i / count) ** n - ((i - 1) / count) ** n) for i, length in enumerate(lengths, 1))


def length_stats(dist: LengthDistribution, n_samples: int = 1, samples_per_step: int = 1) -> LengthStats:
    """The in-flight position, drain curve, group hold and step's longest of ``dist`` (once per cost model)."""
    return LengthStats(
        mean=dist.mean,
        inflight_position=dist.mean_square / (2 * dist.mean),
        drain_from_start=_curve(dist.lengths),
        group_hold=expected_longest(dist.lengths, n_samples) / dist.mean,
        step_longest=expected_longest(dist.lengths, samples_per_step),
    )
