"""tests/gpu/driver_check.py on CPU: the recipe it writes for a one-GPU machine plans (the driver's dry run) with the
relay transport, trainer and server sharing the GPU; and its verdict needs relay updates on every replica and
measured throughput, so a run that moved weights another way, or logged nothing, fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tests/gpu"))
import driver_check  # noqa: E402

UPDATE = "weights v{v}: 0.00 GB to {c}/1 replicas in 0.10 s (re-sent 0, re-routed 0; 1 parts, digest {d}, update {d})"
METRIC = "│ hex/measured/tokens_per_s │ 1234.5 │"


@pytest.mark.slow
@pytest.mark.integration
def test_one_gpu_recipe_plans_the_relay_with_the_gpu_shared(tmp_path: Path) -> None:
    recipe = driver_check.write_recipe(tmp_path, "H200", 1, steps=2)
    (tmp_path / "home").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "HEX_LOCAL_GPUS": "H200:1",
           "HEX_LOCAL_SHARE_GPUS": "1", "AREAL_HEX_TRANSPORT_TOKEN": "0123456789abcdef0123456789abcdef"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "areal_hex_plugin.driver", "--config", str(recipe), "scheduler.type=hex_local",
         "hex.dry_run=true"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weights by relay" in proc.stdout
    assert "actor    part" in proc.stdout and "rollout  part" in proc.stdout and "mem=0.3" in proc.stdout
    assert "weights go to the rollout servers every" not in proc.stdout  # every step: window 1


def test_verdict_needs_relay_updates_on_every_replica_and_measured_throughput() -> None:
    digest = "ab" * 32
    good = "\n".join([UPDATE.format(v=1, c=1, d=digest), UPDATE.format(v=2, c=1, d=digest), METRIC])
    assert driver_check.verdict(0, good)["ok"] is True
    assert driver_check.verdict(0, good)["relay_updates"][1] == {
        "version": 2, "committed": 1, "replicas": 1, "parts": 1
    }  # fmt: skip
    assert driver_check.verdict(1, good)["ok"] is False
    assert driver_check.verdict(0, METRIC)["ok"] is False  # weights moved another way (or not at all)
    assert driver_check.verdict(0, UPDATE.format(v=1, c=1, d=digest))["ok"] is False  # nothing measured
    assert driver_check.verdict(0, UPDATE.format(v=1, c=0, d=digest) + "\n" + METRIC)["ok"] is False
