"""tests/gpu/run_all.sh on a machine without a GPU: nothing runs and it says so (non-zero exit); on a GPU machine as
its probes see it (a stand-in nvidia-smi and an interpreter whose torch reports one GPU), a check that needs sglang
fails without it and a skipped check is not ok unless allowed; forced, each check runs under its own timeout; and
it always prints one JSON summary."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "tests/gpu/run_all.sh"
# The checks, in run order, as --help lists them ("  NAME (HEX_GPU_TIMEOUT_NAME, N s): tests/gpu/NAME_check.py").
CHECKS = re.findall(r"^#   (\w+) \(HEX_GPU_TIMEOUT_", SCRIPT.read_text(), re.MULTILINE)
pytestmark = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="on a GPU machine run_all.sh runs the checks themselves"
)


def _run(tmp_path: Path, *args: str, python: str = sys.executable, **env: str):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(out), "--python", python, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    summary = out / "summary.json"
    return proc, json.loads(summary.read_text()) if summary.exists() else None


def _one_gpu_machine(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """What the probes see on a one-H200 machine: nvidia-smi on PATH, torch reporting one CUDA device (the checks
    themselves run with this machine's Python, so a check that needs CUDA finds none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    python = bin_dir / "python"
    python.write_text(
        '#!/bin/sh\ncase "$2" in *torch.cuda.device_count*) echo 1; exit 0 ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    for path in (smi, python):
        path.chmod(0o755)
    return str(python), {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_help_says_what_it_needs_and_what_each_check_proves(tmp_path: Path) -> None:
    assert CHECKS[:4] == ["transport", "profile", "megatron", "driver"]
    proc, _ = _run(tmp_path, "--help")
    assert proc.returncode == 0
    assert "bash scripts/setup.sh --gpu" in proc.stdout and "--allow-skip" in proc.stdout
    assert "--model" not in proc.stdout and "no model or dataset download" in proc.stdout
    for name in CHECKS:
        assert f"  {name} (HEX_GPU_TIMEOUT_{name.upper()}, " in proc.stdout
        assert f"tests/gpu/{name}_check.py" in proc.stdout
    # Every GPU check in tests/gpu is one of them.
    found = [p.name for p in (REPO / "tests/gpu").glob("*_check.py") if not p.name.startswith("test_")]
    assert sorted(found) == sorted(f"{n}_check.py" for n in CHECKS)


def test_without_a_gpu_nothing_runs_and_it_says_so(tmp_path: Path) -> None:
    proc, summary = _run(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no GPU: nothing ran" in proc.stderr
    assert json.loads(proc.stdout) == summary  # the one JSON summary, printed
    assert summary["ok"] is False and summary["gpus"] == [] and summary["nothing_ran"].startswith("no GPU")
    assert [c["name"] for c in summary["checks"]] == CHECKS
    for check in summary["checks"]:
        assert check["status"] == "not run" and check["ok"] is False, check
    assert not list((tmp_path / "out").glob("*.log"))


def test_on_a_gpu_machine_without_sglang_its_checks_fail_and_skips_are_not_ok(tmp_path: Path) -> None:
    python, env = _one_gpu_machine(tmp_path)
    runs = {}
    for allow in ((), ("--allow-skip", "megatron")):
        proc, summary = _run(tmp_path, *allow, python=python, HEX_GPU_TIMEOUT_TRANSPORT="1", **env)
        assert proc.returncode == 1 and json.loads(proc.stdout) == summary
        runs[allow] = {c["name"]: (c["status"], c["ok"], c["reason"]) for c in summary["checks"]}
    first = runs[()]
    assert summary["gpus"] == ["NVIDIA H200"] and "nothing_ran" not in summary
    assert first["transport"][:2] == ("timeout", False)  # it ran (importing torch alone takes over 1 s)
    for name in ("profile", "driver"):
        assert first[name][:2] == ("failed", False) and first[name][2].startswith("sglang not installed")
    assert first["megatron"][:2] == ("skipped", False) and "megatron-core" in first["megatron"][2]
    assert runs[("--allow-skip", "megatron")]["megatron"][:2] == ("skipped", True)


@pytest.mark.slow
def test_forced_checks_run_under_their_own_timeouts(tmp_path: Path) -> None:
    proc, summary = _run(tmp_path, "--force", HEX_GPU_TIMEOUT_TRANSPORT="1")
    assert proc.returncode == 1 and json.loads(proc.stdout) == summary
    status = {c["name"]: (c["status"], c["exit_code"]) for c in summary["checks"]}
    assert list(status) == CHECKS
    assert {name: status[name] for name in CHECKS[:4]} == {
        "transport": ("timeout", 124),  # importing torch alone takes longer than its 1 s
        "profile": ("skipped", 0),  # pytest's own skip: no CUDA here
        "megatron": ("skipped", 2),  # the check's "cannot run here": fewer than 2 GPUs
        "driver": ("failed", 1),  # the check's own verdict: no sglang
    }
    reasons = {c["name"]: c["reason"] for c in summary["checks"]}
    assert "CUDA" in reasons["profile"] and "2 CUDA GPUs" in reasons["megatron"]
    assert reasons["driver"].startswith("failed: sglang not installed")
    assert all((tmp_path / "out" / c["log"]).exists() for c in summary["checks"])
    assert summary["ok"] is False
