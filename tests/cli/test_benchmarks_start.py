"""Every benchmark script starts (its imports resolve after renames): ``--help`` from the repository root."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(  # the helper modules beside them (report.py, clusters.py) are not run
    p.name for p in (REPO / "benchmarks").glob("*.py") if 'if __name__ == "__main__"' in p.read_text()
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_benchmark_starts(script: str) -> None:
    run = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
