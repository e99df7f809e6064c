"""tests/gpu/transport_check.py on CPU: it imports nothing but torch and the plugin's transport (a GPU machine with
torch alone runs it), and its relay run, from two senders through gloo, is bit-exact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

CHECK = REPO / "tests/gpu/transport_check.py"


def _imported(stderr: str) -> set[str]:
    """Top-level modules named in ``python -X importtime``'s report."""
    return {
        m.split(".")[0] for m in re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", stderr, re.MULTILINE)
    }


@pytest.mark.slow
def test_cpu_run_is_bit_exact_and_imports_only_torch_and_the_transport(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-X", "importtime"]
    baseline = subprocess.Popen([*run, "-c", "import torch"], stderr=subprocess.PIPE, text=True, env=env)
    check = subprocess.run(
        [*run, str(CHECK), "--cpu", "--gb", "0.04", "--json", str(tmp_path / "t.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    _, torch_only = baseline.communicate(timeout=120)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-3000:]
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["ok"] is True and result["gpus"] == 0
    entry = result["gloo_2_senders"]
    assert entry["bit_exact"] is True and entry["senders"] == 2 and entry["receivers"] == 3
    # The check's process and its receivers (spawned with the same -X flag) import beyond torch only the plugin
    # and its chunk MAC (blake3).
    extra = _imported(check.stderr) - _imported(torch_only) - set(sys.stdlib_module_names)
    assert extra == {"areal_hex_plugin", "blake3"}, extra


def test_without_cuda_it_says_it_cannot_run(tmp_path: Path) -> None:
    pytest.importorskip("torch").cuda.is_available() and pytest.skip("a CUDA GPU is here")
    proc = subprocess.run(
        [sys.executable, str(CHECK)], capture_output=True, text=True, timeout=120, env={**os.environ}
    )
    assert proc.returncode == 2 and "no CUDA device: nothing to check" in proc.stderr
