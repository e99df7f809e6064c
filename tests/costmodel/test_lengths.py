"""What the output-length distribution implies for a draining batch."""

from __future__ import annotations

import pytest

from areal_hex_plugin.costmodel.lengths import length_stats
from areal_hex_plugin.specs.workload import LengthDistribution


@pytest.mark.parametrize("lengths", [(100,) * 8, (1, 2, 3, 500, 900, 27648), (10, 20, 30, 40)])
def test_drain_curves_integrate_to_the_exact_tail_work(lengths):
    dist = LengthDistribution(tuple(sorted(lengths)), "test")
    stats = length_stats(dist)
    # Every slot starting together generates E[n]; a steady batch's in-flight residuals are E[n^2] / 2E[n].
    assert stats.drain_from_start.tokens_per_slot == pytest.approx(dist.mean)
    assert stats.inflight_position == pytest.approx(dist.mean_square / (2 * dist.mean))
    shares = [share for _, share, _ in stats.drain_from_start.steps]
    assert shares == sorted(shares, reverse=True) and all(0 <= s <= 1 for s in shares)


def test_a_heavier_tail_means_a_longer_in_flight_context():
    light = length_stats(LengthDistribution.lognormal(2000, 0.3, 27648)).inflight_position
    heavy = length_stats(LengthDistribution.lognormal(2000, 1.2, 27648)).inflight_position
    assert heavy > 1.5 * light
