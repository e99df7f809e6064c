"""Which way upstream AReaL reaches the plugin, as README.md states it: areal 1.0.4 as released reads no
``areal.plugins`` entry point (recipes run through the plugin's driver), and with ``patches/0001``-``0004`` applied
upstream's own loader finds the plugin's declared entry point and gets the Hex schedulers and the relay from it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("areal")
sys.path.insert(0, str(REPO / "patches"))
import check_patches  # noqa: E402

PROBE = """
from areal.api import plugins, weight_transport
assert plugins.get_scheduler("hex_local") is None
plugins.load_plugins()  # what upstream's trainers call (patches/0004) before building scheduler.type
factory = plugins.get_scheduler("hex_local")
assert factory.args == ("areal_hex_plugin.areal.schedulers.local.HexLocalScheduler",), factory
assert type(weight_transport.get_weight_transport("hex_relay")).__name__ == "RelayWeightTransport"
print("loaded through the entry point")
"""


def test_released_areal_reads_no_plugin_entry_point() -> None:
    import areal

    root = Path(areal.__path__[0])
    readers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"entry_points\(|areal\.plugins", path.read_text(errors="replace"))
    ]
    assert readers == []
    # The README says so, and names the patch and the driver.
    readme = (REPO / "README.md").read_text()
    assert "areal 1.0.4 as released reads no entry point" in readme
    assert "python -m areal_hex_plugin.driver" in readme and "patches/0004" in readme


@pytest.mark.integration
@pytest.mark.slow
def test_patched_areal_loads_the_plugin_through_its_entry_point(tmp_path: Path) -> None:
    results = check_patches.apply_all(tmp_path)
    assert [ok for _, ok, _ in results] == [True] * len(check_patches.PATCHES), results
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded through the entry point" in proc.stdout
