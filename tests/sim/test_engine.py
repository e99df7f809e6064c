"""The event loop against cases with known answers: steady rates, staleness bounds, routing, determinism."""

from __future__ import annotations

import dataclasses

import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.spec import LaneSpec, SimSpec, linear_steps
from areal_hex_plugin.sim.staleness import AdmissionControl
from areal_hex_plugin.specs.workload import LengthDistribution

LONG_TAIL = LengthDistribution.lognormal(2000, 0.9, 16384).lengths


def lane(name="a", count=4, share=1.0, max_running=64, fixed=0.01, per_seq=0.0002, prefill=1e9, pool="r"):
    return LaneSpec(name, pool, 1, count, share, linear_steps(fixed, per_seq, max_running), prefill)


def spec(**changes) -> SimSpec:
    base = SimSpec(
        lanes=(lane(),),
        lengths=LONG_TAIL,
        prompt_tokens=256,
        n_samples=4,
        batch=32,
        max_staleness=2,
        max_concurrent_rollouts=64,
        train_s=20.0,
        sync_s=2.0,
        train_gpus={"t": 8},
    )
    return dataclasses.replace(base, **changes)


def test_same_seed_same_run_and_another_seed_differs():
    first = simulate(spec(), steps=8, seed=3).to_dict()
    assert simulate(spec(), steps=8, seed=3).to_dict() == first
    assert simulate(spec(), steps=8, seed=4).to_dict() != first


def test_full_replicas_decode_at_the_step_line_rate():
    # Constant lengths, every replica always full, free prefill, instant training and sync: samples finish at
    # count * max_running / (length * step(max_running)) per second.
    length, running, count = 500, 64, 4
    s = spec(
        lanes=(lane(count=count, max_running=running),),
        lengths=(length,),
        n_samples=1,
        batch=64,
        max_staleness=1000,
        max_concurrent_rollouts=count * running,
        train_s=1e-6,
        sync_s=0.0,
        kv_recompute=False,
    )
    result = simulate(s, steps=40, seed=0)
    step_s = 0.01 + 0.0002 * running
    expected = count * running / (length * step_s) * (length + s.prompt_tokens)
    assert result.tokens_per_s == pytest.approx(expected, rel=0.02)


def test_training_bound_steps_take_train_plus_sync_and_respect_eta():
    s = spec(lanes=(lane(count=16, max_running=256),), lengths=(400, 800), train_s=50.0, sync_s=5.0)
    result = simulate(s, steps=12, seed=1)
    assert result.step_time_s == pytest.approx(55.0)
    assert result.mean("rollout_wait_s") == pytest.approx(0.0)
    # Generation is shorter than a step, so the staleness window fills: consumed samples lag exactly eta.
    assert max(result.staleness) == s.max_staleness == 2
    assert sum(result.staleness.values()) == 12 * s.batch * s.n_samples


def test_eta_zero_is_synchronous():
    result = simulate(spec(max_staleness=0), steps=6, seed=2)
    assert set(result.staleness) == {0}
    # Nothing overlaps: each step waits for its own generation.
    assert all(step.rollout_wait_s > 0 for step in result.steps)


def test_kv_recompute_after_weight_updates_costs_time_when_rollout_bound():
    slow_prefill = (lane(count=2, max_running=64, prefill=20000.0),)
    with_recompute = simulate(spec(lanes=slow_prefill, train_s=1.0), steps=10, seed=0)
    without = simulate(spec(lanes=slow_prefill, train_s=1.0, kv_recompute=False), steps=10, seed=0)
    assert with_recompute.interrupted > 0
    assert with_recompute.recompute_s_per_update > 0 == without.recompute_s_per_update
    assert with_recompute.tokens_per_s < 0.95 * without.tokens_per_s


def test_rollouts_follow_the_plan_shares():
    lanes = (lane("fast", count=3, share=0.75), lane("slow", count=1, share=0.25, per_seq=0.0008))
    result = simulate(spec(lanes=lanes), steps=10, seed=0)
    total = sum(result.routed.values())
    assert result.routed["fast"] / total == pytest.approx(0.75, abs=0.01)


def test_idle_fraction_and_breakdown_add_up():
    result = simulate(spec(), steps=10, seed=0)
    for name, usage in result.pools.items():
        assert 0.0 <= usage.idle_fraction <= 1.0, name
    window = sum(s.step_s for s in result.measured)
    train = result.pools["t"]
    assert train.train_s + train.sync_s + train.idle_s == pytest.approx(train.gpus * window)
    rollout = result.pools["r"]
    assert rollout.rollout_s + rollout.sync_s + rollout.idle_s == pytest.approx(rollout.gpus * window)
    assert rollout.rollout_idle_s == pytest.approx(rollout.idle_s)
    assert result.rollout_idle_s == pytest.approx(rollout.idle_s / rollout.gpus / len(result.measured))
    for step in result.steps:
        assert step.step_s == pytest.approx(step.rollout_wait_s + step.train_s + step.sync_s)


def test_timeline_rows_cover_the_trainer_and_every_replica():
    result = simulate(spec(), steps=3, seed=0, timeline=True)
    replicas = {f"a #{k}" for k in range(4)}
    assert {pool: set(rows) for pool, rows in result.timeline.items()} == {"t": {"trainer"}, "r": replicas}
    states = {seg.state for seg in result.timeline["r"]["a #0"]}
    assert {"decode", "sync"} <= states
    assert [seg.state for seg in result.timeline["t"]["trainer"]][:3] == ["wait", "train", "sync"]


def test_admission_control_formula():
    control = AdmissionControl(max_concurrent_rollouts=10, consumer_batch_size=4, max_staleness=1)
    assert control.capacity(version=0) == 8  # (1 + 0 + 1) * 4 - 0
    for _ in range(8):
        control.on_submitted()
    assert control.capacity(version=0) == 0
    control.on_accepted()
    assert control.capacity(version=0) == 0  # accepted still counts toward the window
    assert control.capacity(version=1) == 3  # concurrency: 10 - 7 running
    control.on_rejected()
    assert control.capacity(version=1) == 4


def test_a_spec_without_replicas_is_refused():
    with pytest.raises(ValueError, match="rollout replica"):
        simulate(spec(lanes=()), steps=1)


def test_rewards_on_few_workers_bound_the_step():
    # 32 samples per step, 1 s each on 2 reward workers: no step can be shorter than 16 s of scoring.
    fast = spec(lengths=(200,), batch=8, train_s=1.0, sync_s=0.0, reward_s_per_sample=1.0, reward_workers=2)
    result = simulate(fast, steps=12, seed=0)
    assert result.step_time_s == pytest.approx(16.0, rel=0.02)
    unscored = simulate(dataclasses.replace(fast, reward_s_per_sample=0.0), steps=12, seed=0)
    assert unscored.step_time_s < 8.0


def test_a_staleness_window_smaller_than_a_batch_is_a_clear_error():
    with pytest.raises(HexError, match="consumer_batch_size") as caught:
        simulate(spec(consumer_batch=8, batch=32, max_staleness=0), steps=2)
    assert "wait forever" in caught.value.message


def test_weight_update_recomputes_generated_tokens_and_each_rollouts_prompt_once():
    # One replica at a constant 10 ms step; 2 rollouts of 2 samples (1,000 tokens) in flight at each moment.
    s = spec(
        lanes=(LaneSpec("a", "r", 1, 1, 1.0, linear_steps(0.01, 0.0, 64), 1e4),),
        lengths=(1000,),
        prompt_tokens=100,
        n_samples=2,
        batch=1,
        max_staleness=4,
        max_concurrent_rollouts=2,
        train_s=5.0,
        sync_s=1.0,
    )
    result = simulate(s, steps=2, seed=0, timeline=True)
    first = result.steps[0]
    # Step 1's rollouts end at 0.02 + 10 s; the next two start at 10.02 and prefill their prompts until 10.04,
    # then decode until the update at 15.02: 498 tokens each. On resume: 2 prompts + 4 x 498 tokens at 10k/s.
    assert first.end_s == pytest.approx(16.02)
    segment = next(seg for seg in result.timeline["r"]["a #0"] if seg.start_s == pytest.approx(first.end_s))
    assert segment.state == "prefill"
    assert segment.end_s - segment.start_s == pytest.approx((2 * 100 + 4 * 498) / 1e4)
