"""Our admission control and upstream AReaL's real ``StalenessManager`` give the same capacity, always.

Both are driven by the same random sequences of the events the rollout controller produces (submit while there
is capacity or not, accept, reject, version bumps) and compared after every event.
"""

from __future__ import annotations

import random

import pytest

from areal_hex_plugin.sim.staleness import AdmissionControl

pytestmark = pytest.mark.integration


class _Version:
    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version


@pytest.mark.parametrize("seed", range(40))
def test_same_capacities_as_upstream_on_random_event_sequences(seed: int) -> None:
    from areal.infra.staleness_manager import StalenessManager

    rng = random.Random(seed)
    max_concurrent = rng.choice([0, 1, 3, 16, 64, 512])
    batch = rng.choice([0, 1, 4, 32, 64])
    eta = rng.choice([0, 1, 2, 4, 8])
    version = _Version()
    upstream = StalenessManager(version, max_concurrent, batch, eta)
    ours = AdmissionControl(max_concurrent, batch, eta)
    running = 0
    for _ in range(600):
        event = rng.random()
        if event < 0.45:
            # The dispatcher submits while capacity is positive; sometimes force one past it, as a burst would.
            if upstream.get_capacity() > 0 or rng.random() < 0.1:
                upstream.on_rollout_enqueued()
                upstream.on_rollout_submitted()
                ours.on_submitted()
                running += 1
        elif event < 0.8 and running:
            upstream.on_rollout_accepted()
            ours.on_accepted()
            running -= 1
        elif event < 0.88 and running:
            upstream.on_rollout_rejected()
            ours.on_rejected()
            running -= 1
        elif event >= 0.88:
            version.version += 1
        assert ours.capacity(version.version) == upstream.get_capacity()
        stats = upstream.get_stats()
        assert (ours.running, ours.accepted, ours.rejected) == (stats.running, stats.accepted, stats.rejected)
