"""Weights to the rollout servers every ``window`` training steps: the plan's delta(eta) (``solver.window_steps``).

Upstream's loop (``PPOTrainer.train``) calls ``actor.update_weights(meta)`` with the new version and then
``rollout.set_version(version)`` after every training step. With a window k > 1 the steps whose new version is not
a multiple of k skip the update, and the rollout keeps the version of the weights its servers hold. Upstream's
staleness manager admits rollouts against that version, so no sample is more than eta versions behind the
policy that trains on it, as with k = 1; the planner counted the fewer rollouts this admits (``inflight.py``).
The trainer's own version (``actor.set_version``) advances every step, as upstream's. The window may change
mid-run (a re-plan applied live, ``elastic/relayout.py``): from the next step on.
"""

from __future__ import annotations


class UpdateWindow:
    """Weights go out on every ``steps``-th version (1: every step, upstream's loop)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.pushed = True  # whether the last version went out

    def update(self, version: int) -> bool:
        self.pushed = version % max(1, self.steps) == 0
        return self.pushed


def push_every(window: int, actor, rollouts) -> UpdateWindow:
    """Make ``actor.update_weights`` and each rollout's ``set_version`` act on every ``window``-th version only;
    the window, which may be changed later."""
    every = UpdateWindow(window)
    update_weights = actor.update_weights

    def update_every_window(meta):
        return update_weights(meta) if every.update(meta.version) else None

    actor.update_weights = update_every_window
    for rollout in rollouts:
        set_version = rollout.set_version

        def set_pushed_version(version, set_version=set_version):
            if every.pushed:
                set_version(version)

        rollout.set_version = set_pushed_version
    return every
