"""Issue 23: rollout as latency physics. The per-iteration decode time, the step's longest sample at the cap,
the H20/H800 ratio moving with output length, and physical ranges refused where a fit leaves them."""

from __future__ import annotations

import random

import pytest

from areal_hex_plugin.costmodel import CostModel, RolloutStage
from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.decode import decode_iteration_s
from areal_hex_plugin.costmodel.lengths import expected_longest
from areal_hex_plugin.costmodel.rollout import _build_stages
from areal_hex_plugin.costmodel.single_type import best_rollout
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.inflight import window_rollout_s
from areal_hex_plugin.planner.rollout_model import ReplicaConfig
from areal_hex_plugin.specs.workload import LengthDistribution
from tests.costmodel.helpers import cost_model, recipe

PAPER_7B = "paper/7b.yaml"
NO_CAP_MASS = "hex.workload.output_lengths.cap_share=0"


def _replica(cm: CostModel, pool: str, tp: int = 1):
    stages = (RolloutStage(pool, tp),)
    return _build_stages(
        cm.cluster, cm.workload, cm.calibration, stages, (cm.workload.model.layers,), {pool: tp}
    )[0]


def test_one_decode_iteration_is_weights_plus_kv_plus_overhead_from_the_roofline():
    """7B on one H800-PCIe at the generic factors, worked by hand from the model's config.json: weights, the KV of
    every context token, at 80% of 2 TB/s, plus the 1 ms per-iteration overhead."""
    r = recipe(PAPER_7B)
    cm = CostModel(r.cluster, r.workload, Calibration())
    replica = _replica(cm, "h800")
    # 7,615,616,512 parameters (Qwen2-7B: 28 layers of hidden 3584, 4 KV heads of 128, FFN 18944, vocabulary
    # 152064, untied, QKV bias) x 2 bytes = 15,231,233,024 bytes; KV per context token 28 x 2 x 4 x 128 x 2 =
    # 57,344 bytes. At 1.6e12 B/s: (15,231,233,024 + 1000 x 57,344) / 1.6e12 = 9.5553606 ms, + 1 ms.
    one, source = decode_iteration_s(replica, 1, 1000)
    assert source == "roofline"
    assert one == pytest.approx(10.5553606e-3, rel=1e-6)
    # Each more sequence reads its own KV; the weights are read once per iteration: 7 x 1000 x 57,344 / 1.6e12
    # = 0.25088 ms.
    assert decode_iteration_s(replica, 8, 1000)[0] - one == pytest.approx(0.25088e-3, rel=1e-6)
    assert decode_iteration_s(replica, 1, 9000)[0] > one


def test_the_h20_to_h800_decode_ratio_rises_with_output_length():
    """Per GPU at the best replica: short outputs give large compute-bound batches (H800's 756 TFLOPS win), long
    ones small KV-bound batches that read every context token (H20's 4 TB/s win). The generic factors show the
    physics; the paper fit moves it the same way."""
    for calibration in (Calibration(), None):
        ratios = []
        for mean in (300, 1000, 3000, 9000):
            extra = (f"hex.workload.output_lengths.mean_tokens={mean}", NO_CAP_MASS)
            cm = cost_model(PAPER_7B, *extra)
            if calibration is not None:
                cm = CostModel(cm.cluster, cm.workload, calibration)
            per_gpu = {}
            for pool in ("h20", "h800"):
                _, est = best_rollout(cm, cm.cluster.pool(pool), 1)
                per_gpu[pool] = est.tokens_per_s / est.n_gpus
            ratios.append(per_gpu["h20"] / per_gpu["h800"])
        assert ratios == sorted(ratios) and ratios[-1] > 1.5 * ratios[0], ratios
    assert ratios[0] < 1  # at short outputs the H800 is the faster decoder


def test_the_cap_is_a_point_mass_the_step_waits_for():
    lengths = LengthDistribution.lognormal(2400, 0.9, 27648, cap_share=0.015)
    assert lengths.mean == pytest.approx(2400, rel=0.01)
    assert lengths.quantile(0.99) == 27648 and lengths.quantile(0.98) < 27648
    # 1,024 samples a step: the step's longest is the cap, though 1.5% of samples reach it.
    assert expected_longest(lengths.lengths, 1024) == pytest.approx(27648, rel=1e-3)
    with pytest.raises(HexError, match="cap_share"):
        recipe(PAPER_7B, "hex.workload.output_lengths.cap_share=0.1")  # 10% at 27,648 alone exceed 2,400


@pytest.mark.parametrize("eta", [0, 1, 2, 4, 8])
def test_rollout_time_of_a_step_grows_with_the_cap_at_every_eta(eta):
    """The same mean and cap share, a longer cap: the step's longest sample decodes longer, whatever the
    staleness bound (at eta >= 1 its tail overlaps the next steps' samples, but it still ends the step)."""
    times = []
    for cap in (8192, 16384, 27648):
        cm = cost_model(
            PAPER_7B,
            f"gconfig.max_new_tokens={cap}",
            f"gconfig.max_tokens={cap + 1024}",
            f"sglang.context_length={cap + 1024}",
            f"rollout.max_head_offpolicyness={eta}",
        )
        est = cm.rollout((RolloutStage("h800", 1),), max_sequences=64)
        config = ReplicaConfig(
            "h800", 1, 1, est.tokens_per_s, est.concurrency, est.recompute_s, est.longest_s
        )
        samples = cm.workload.rl.samples_per_step
        # About the same tokens per step (an 8k cap trims the lognormal part's own tail: 2,269 mean).
        assert cm.workload.output_lengths.mean == pytest.approx(2400, rel=0.06)
        times.append(window_rollout_s(((config, 16),), samples, cm.workload.output_lengths.mean, updates=1))
        # The longest sample, not the tokens at the replica's rate, ends this step.
        assert times[-1] == pytest.approx(est.longest_s + est.recompute_s)
    assert times == sorted(times) and times[-1] > 2 * times[0], times


@pytest.mark.parametrize("eta", [0, 8])
def test_a_drain_adds_the_longest_sample_less_the_in_flight_tokens(eta):
    """Issue 26: a window whose pipeline drains before its update (planner/inflight.py, ``drains``) waits for its
    longest sample, while the batch in flight still had its remaining tokens to generate at full speed; at eta = 0
    every step drains so. The two length figures are drawn here (Monte Carlo), not taken from the cost model: the
    step's longest of its samples (the cap's point mass makes it the cap), and the mean position of a sequence in
    flight (each seen in proportion to its length, at a uniform point of it)."""
    cm = cost_model(PAPER_7B, f"rollout.max_head_offpolicyness={eta}")
    est = cm.rollout((RolloutStage("h800", 1),), max_sequences=64)
    lengths, rng = cm.workload.output_lengths, random.Random(0)
    longest = sum(max(lengths.sample(rng, cm.workload.rl.samples_per_step)) for _ in range(20)) / 20
    draws = lengths.sample(rng, 200_000)
    position = sum(n * n for n in draws) / (2 * sum(draws))
    expected = longest * est.step_time_s - est.concurrency * position / est.tokens_per_s
    assert est.drain_s == pytest.approx(expected, rel=0.01) and est.drain_s > 0.5 * est.longest_s
