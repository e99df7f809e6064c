"""The relay in upstream's weight-transport registry (patches/0003, 0004 applied to a copy of areal 1.0.4): a real
2-rank upstream FSDPPPOActor (gloo, no plugin subclass) with ``weight_update_mode: hex_relay`` finds the relay
through the plugin's entry point, every rank sends its share, and the SGLang stand-in (TP 2) commits the version
bit-exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.transport.route import PoolRoute, Route  # noqa: E402
from tests.transport.harness import TOKEN  # noqa: E402
from tests.transport.test_fsdp_actor import _free_port, _save_model, assert_server_holds, replica  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_upstream_fsdp_actor_runs_the_relay_from_the_registry(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    sys.path.insert(0, str(REPO / "patches"))
    import check_patches

    areal_root = tmp_path / "areal-patched"
    areal_root.mkdir()
    assert all(ok for _, ok, _ in check_patches.apply_all(areal_root))
    expected = _save_model(tmp_path / "model")
    server, engine, endpoint = replica(tmp_path)
    # What RelayWeightTransport.build_meta puts in the meta for the train workers.
    options = {
        "route": Route([PoolRoute("h20", [endpoint], 1.5, 5.0)]).to_dict(),
        "sender": {"backend": "gloo", "timeout_s": 30.0},
        "replicas": 1,
        "min_committed_fraction": 1.0,
    }
    port = _free_port()
    env = {
        "PYTHONPATH": f"{areal_root}:{REPO}",
        "HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin",
        "AREAL_HEX_TRANSPORT_TOKEN": TOKEN.decode(),
    }
    code = "from tests.transport.fsdp_rank import run_registry_rank as run; run({}, 2, {}, {!r}, {!r}, {!r})"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code.format(rank, port, str(tmp_path / "model"), server.address, options)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [rank.communicate(timeout=300)[0] for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    finally:
        for rank in ranks:
            rank.kill()
        engine.hex_stop_receiver()
        engine.destroy()
        server.close()
    assert "Loading plugin hex" in "".join(logs)  # found through the entry point, in the workers
    assert "weights v3:" in logs[0] and "2 parts" in logs[0]  # rank 0 committed and checked the report
    assert engine.get_version() == 3
    assert_server_holds(server, expected)
