"""The simulator is core: it imports and runs with areal and torch blocked outright."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from tests.specs.test_core_imports import BLOCKER


def test_simulate_runs_without_areal_or_torch():
    code = BLOCKER + "\n".join(
        [
            "import areal_hex_plugin.sim.engine, areal_hex_plugin.sim.inputs, areal_hex_plugin.sim.reproduce",
            "from areal_hex_plugin.cli import main",
            f"assert main(['simulate', {str(REPO / 'recipes/paper/1.5b.yaml')!r}, '--steps', '2']) == 0",
            "assert not any(m.split('.')[0] in {'areal', 'torch'} for m in sys.modules)",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "simulated 2 steps" in done.stdout
