"""Invariants of the event loop over random small specs (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.spec import LaneSpec, SimSpec, linear_steps

lanes = st.lists(
    st.builds(
        lambda count, running, fixed, per_seq, prefill, share, gpus: (
            count,
            running,
            fixed,
            per_seq,
            prefill,
            share,
            gpus,
        ),
        st.integers(1, 4),
        st.integers(1, 48),
        st.floats(1e-3, 0.05),
        st.floats(0.0, 1e-3),
        st.floats(1e3, 1e6),
        st.floats(0.05, 1.0),
        st.sampled_from([1, 2, 4]),
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def specs(draw) -> SimSpec:
    drawn = draw(lanes)
    return SimSpec(
        lanes=tuple(
            LaneSpec(f"g{i}", f"p{i % 2}", gpus, count, share, linear_steps(fixed, per_seq, running), prefill)
            for i, (count, running, fixed, per_seq, prefill, share, gpus) in enumerate(drawn)
        ),
        lengths=tuple(sorted(draw(st.lists(st.integers(1, 3000), min_size=1, max_size=20)))),
        prompt_tokens=draw(st.integers(1, 512)),
        n_samples=draw(st.integers(1, 8)),
        batch=draw(st.integers(1, 24)),
        max_staleness=draw(st.integers(0, 4)),
        max_concurrent_rollouts=draw(st.integers(0, 64)),
        train_s=draw(st.floats(0.0, 30.0)),
        sync_s=draw(st.floats(0.0, 5.0)),
        train_gpus={"p0": draw(st.integers(1, 16))},
        reward_s_per_sample=draw(st.sampled_from([0.0, 0.01, 0.5])),
        reward_workers=draw(st.integers(1, 8)),
        kv_recompute=draw(st.booleans()),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), steps=st.integers(1, 6), seed=st.integers(0, 3))
def test_every_run_is_consistent(spec: SimSpec, steps: int, seed: int) -> None:
    result = simulate(spec, steps=steps, seed=seed)
    assert len(result.steps) == steps
    assert sum(result.staleness.values()) == steps * spec.batch * spec.n_samples
    assert min(result.staleness) >= 0
    end = 0.0
    for step in result.steps:
        assert step.start_s == pytest.approx(end, abs=1e-9)
        assert step.rollout_wait_s >= 0
        assert step.tokens >= spec.batch * spec.n_samples * (spec.prompt_tokens + min(spec.lengths))
        end = step.end_s
    for usage in result.pools.values():
        assert 0.0 <= usage.idle_fraction <= 1.0
    assert sum(result.routed.values()) >= steps * spec.batch
    assert simulate(spec, steps=steps, seed=seed).to_dict() == result.to_dict()
