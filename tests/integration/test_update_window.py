"""The driver runs the plan's update window: weights and the rollout version move every window steps only."""

from __future__ import annotations

import pytest

pytest.importorskip("areal")
pytestmark = pytest.mark.integration

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402
from areal.api.io_struct import WeightUpdateMeta  # noqa: E402
from areal.engine.sglang_remote import RemoteSGLangEngine  # noqa: E402

from areal_hex_plugin.areal.update_window import push_every  # noqa: E402


class _Actor:
    """Records the versions it would push (the real push needs servers)."""

    def __init__(self) -> None:
        self.pushed: list[int] = []

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self.pushed.append(meta.version)


def _run_steps(window: int, steps: int) -> tuple[list[int], list[int]]:
    """Upstream's per-step sequence (PPOTrainer.train): update_weights(meta v), then rollout.set_version(v)."""
    actor, rollout = _Actor(), RemoteSGLangEngine(InferenceEngineConfig())
    push_every(window, actor, [rollout])
    meta = WeightUpdateMeta(type="disk")
    versions = []
    for step in range(steps):
        actor.update_weights(meta.with_version(step + 1))
        rollout.set_version(step + 1)
        versions.append(rollout.get_version())
    return actor.pushed, versions


def test_a_window_of_three_pushes_every_third_version_and_the_rollout_serves_it():
    pushed, versions = _run_steps(3, 7)
    assert pushed == [3, 6]
    assert versions == [0, 0, 3, 3, 3, 6, 6]


def test_a_window_of_one_is_upstreams_loop():
    pushed, versions = _run_steps(1, 3)
    assert pushed == [1, 2, 3] and versions == [1, 2, 3]


def test_a_window_changed_mid_run_applies_from_the_next_step():
    """A live re-layout's plan may change the window (``elastic/relayout.py``): 2 -> 1 after step 3."""
    actor, rollout = _Actor(), RemoteSGLangEngine(InferenceEngineConfig())
    window = push_every(2, actor, [rollout])
    meta = WeightUpdateMeta(type="disk")
    versions = []
    for step in range(6):
        if step == 3:
            window.steps = 1
        actor.update_weights(meta.with_version(step + 1))
        rollout.set_version(step + 1)
        versions.append(rollout.get_version())
    assert actor.pushed == [2, 4, 5, 6] and versions == [0, 2, 2, 4, 5, 6]
