"""What the output-length distribution implies for a continuously batched rollout replica."""

from __future__ import annotations

from dataclasses import dataclass

from areal_hex_plugin.specs.workload import LengthDistribution


@dataclass(frozen=True)
class LengthStats:
    mean: float
    # Mean decode position of the sequences in flight when the batch is kept full: sequences are seen in
    # proportion to their length, at a uniform point of it (E[n^2] / 2E[n]).
    inflight_position: float
    # Expected longest of a rollout's n_samples lengths over the mean length. Upstream's admission counts
    # rollouts, and one holds its slot until its longest sample ends, so keeping k sequences decoding takes
    # k / n_samples * group_hold rollouts admitted.
    group_hold: float = 1.0
    # Expected longest of a step's samples (the cap, once the distribution's point mass there is reached by a
    # step's draws): the step's rollout cannot end before it does.
    step_longest: float = 0.0


def expected_longest(lengths: tuple[int, ...], n: int) -> float:
    """Exact expected maximum of ``n`` independent draws from the sorted sample ``lengths``."""
    count = len(lengths)
    return sum(length * ((i / count) ** n - ((i - 1) / count) ** n) for i, length in enumerate(lengths, 1))


def length_stats(dist: LengthDistribution, n_samples: int = 1, samples_per_step: int = 1) -> LengthStats:
    """The in-flight position, group hold and step's longest of ``dist`` (once per cost model)."""
    return LengthStats(
        mean=dist.mean,
        inflight_position=dist.mean_square / (2 * dist.mean),
        group_hold=expected_longest(dist.lengths, n_samples) / dist.mean,
        step_longest=expected_longest(dist.lengths, samples_per_step),
    )
