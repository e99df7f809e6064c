"""What the elastic tests share: the rig's settings and helpers (its fixtures are in ``conftest.py``)."""

from __future__ import annotations

import time

from areal_hex_plugin.planner.reshare import ServerShape
from areal_hex_plugin.specs.config import ElasticConfig

CONFIG = ElasticConfig(health_interval_s=0.2, health_timeout_s=0.5, failures_to_down=2, drift_min_samples=4)
SHAPES = [ServerShape("big", 1), ServerShape("small", 2)]


class Version:
    def get_version(self) -> int:
        return 0


def versioned_standin(tp: int = 2):
    """A stand-in that answers SGLang's label of the loaded weights, as the e2e stand-in does."""
    from tests.transport.sglang_standin import SGLangStandIn

    server = SGLangStandIn(tp)
    server.app.add_url_rule(
        "/get_weight_version", "version", lambda: {"weight_version": server.weight_version}, methods=["GET"]
    )
    return server


def wait(condition, seconds: float) -> float:
    """Wait for ``condition()``; the seconds it took (fails the test after ``seconds``)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start
