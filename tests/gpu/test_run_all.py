"""tests/gpu/run_all.sh on a machine without a GPU: it explains itself, skips every check cleanly, runs each
check under its own timeout when forced, and always writes one valid JSON summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "tests/gpu/run_all.sh"
CHECKS = ["transport", "profile", "megatron", "driver"]
pytestmark = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="on a GPU machine run_all.sh runs the checks themselves"
)


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(out), "--python", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    summary = out / "summary.json"
    return proc, json.loads(summary.read_text()) if summary.exists() else None


def test_help_says_what_it_needs_and_what_each_check_proves(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--help")
    assert proc.returncode == 0
    assert 'python -m pip install -e ".[gpu,dev]"' in proc.stdout and "--model" in proc.stdout
    for name in CHECKS:
        assert f"  {name} (HEX_GPU_TIMEOUT_{name.upper()}, " in proc.stdout
        assert f"tests/gpu/{name}_check.py" in proc.stdout
    # Every GPU check in tests/gpu is one of them.
    assert sorted(p.name for p in (REPO / "tests/gpu").glob("*_check.py")) == sorted(
        f"{n}_check.py" for n in CHECKS
    )


def test_without_a_gpu_every_check_is_skipped_and_the_summary_is_valid(tmp_path: Path) -> None:
    proc, summary = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["ok"] is True and summary["gpus"] == []
    assert [c["name"] for c in summary["checks"]] == CHECKS
    for check in summary["checks"]:
        assert check["status"] == "skipped" and check["reason"].startswith("no CUDA GPU"), check


@pytest.mark.slow
def test_forced_checks_run_under_their_own_timeouts(tmp_path: Path) -> None:
    proc, summary = _run(tmp_path, "--force", HEX_GPU_TIMEOUT_TRANSPORT="1")
    assert proc.returncode == 1
    status = {c["name"]: (c["status"], c["exit_code"]) for c in summary["checks"]}
    assert status == {
        "transport": ("timeout", 124),  # importing torch alone takes longer than its 1 s
        "profile": ("skipped", 0),  # pytest's own skip: no CUDA here
        "megatron": ("skipped", 2),  # the check's "cannot run here": fewer than 2 GPUs
        "driver": ("skipped", 2),  # the check's "cannot run here": no sglang
    }
    reasons = {c["name"]: c["reason"] for c in summary["checks"]}
    assert (
        "CUDA" in reasons["profile"]
        and "2 CUDA GPUs" in reasons["megatron"]
        and "sglang" in reasons["driver"]
    )
    assert all((tmp_path / "out" / c["log"]).exists() for c in summary["checks"])
    assert summary["ok"] is False
