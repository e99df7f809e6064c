"""What the output-length distribution implies for a steady batch and for rollout admission."""

from __future__ import annotations

import itertools
import math

import pytest

from areal_hex_plugin.costmodel.lengths import expected_longest, length_stats
from areal_hex_plugin.specs.workload import LengthDistribution
from tests.costmodel.helpers import cost_model

PAPER_1_5B = "paper/1.5b.yaml"


@pytest.mark.parametrize("lengths", [(100,) * 8, (1, 2, 3, 500, 900, 27648), (10, 20, 30, 40)])
def test_a_steady_batch_is_seen_at_its_in_flight_position(lengths):
    dist = LengthDistribution(tuple(sorted(lengths)), "test")
    # A steady batch's in-flight residuals are E[n^2] / 2E[n].
    assert length_stats(dist).inflight_position == pytest.approx(dist.mean_square / (2 * dist.mean))


def test_a_heavier_tail_means_a_longer_in_flight_context():
    light = length_stats(LengthDistribution.lognormal(2000, 0.3, 27648)).inflight_position
    heavy = length_stats(LengthDistribution.lognormal(2000, 1.2, 27648)).inflight_position
    assert heavy > 1.5 * light


@pytest.mark.parametrize(
    ("lengths", "n"), [((10, 20, 30, 40), 1), ((10, 20, 30, 40), 3), ((5, 5, 7, 900), 2)]
)
def test_expected_longest_matches_enumeration(lengths, n):
    draws = list(itertools.product(lengths, repeat=n))
    assert expected_longest(lengths, n) == pytest.approx(sum(max(d) for d in draws) / len(draws))


def test_a_rollout_holds_its_admission_slot_until_its_longest_sample_ends():
    dist = LengthDistribution.lognormal(2000, 0.9, 27648)
    assert length_stats(dist, 1).group_hold == pytest.approx(1.0)
    holds = [length_stats(dist, n).group_hold for n in (2, 8, 16)]
    assert holds == sorted(holds) and 2.0 < holds[1] < holds[2] < dist.max / dist.mean
    # 512 sequences in groups of 8: 64 rollouts only while every sample runs; 2-3.5x as many on average.
    cm = cost_model("mixes/a100_l40s_qwen2.5-7b.yaml")
    assert cm.workload.rl.n_samples == 8
    hold = length_stats(cm.workload.output_lengths, 8).group_hold
    assert 2.0 < hold < 3.5 and cm.prompts_to_fill(512) == math.ceil(64 * hold)
    assert cost_model(PAPER_1_5B, "gconfig.n_samples=1").prompts_to_fill(512) == 512
