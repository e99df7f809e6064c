"""What a rollout machine holds in memory during a commit: the new version in the stage dir (``/dev/shm`` in
production) and, with ``hex.relay.rollback_dir``, the last committed one on node-local disk, where a failed load
still finds it. Measured as the bytes of the files under the stage dir at every load the server makes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route  # noqa: E402
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig  # noqa: E402
from tests.transport.harness import TOKEN, in_buckets, small_qwen2_state_dict  # noqa: E402
from tests.transport.receiver_engine import ReceiverEngine  # noqa: E402
from tests.transport.sglang_standin import SGLangStandIn  # noqa: E402

pytestmark = pytest.mark.integration


def _in_memory(stage: Path) -> int:
    """Bytes of the files under ``stage`` (a link to a version moved to disk is not followed)."""
    return sum(
        os.lstat(os.path.join(folder, name)).st_size
        for folder, _, names in os.walk(stage)
        for name in names
        if not os.path.islink(os.path.join(folder, name))
    )


def _peak_during_commits(tmp_path: Path, monkeypatch, rollback_dir: str | None) -> float:
    """Four versions (the third's load fails half-way and rolls back); the most the stage dir held at a load, in
    units of the model's size."""
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    server = SGLangStandIn(tp_size=2)
    engine = ReceiverEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="t", pause_grace_period=0.0, setup_timeout=30)
    )
    engine.initialize(addr=server.address, train_data_parallel_size=1)
    stage = tmp_path / "stage"
    held = []
    load = server._load

    def measured(path: Path, fail_half_way: bool = False) -> None:
        held.append(_in_memory(stage))
        load(path, fail_half_way)

    server._load = measured
    states = [small_qwen2_state_dict(seed) for seed in range(4)]
    try:
        address = engine.hex_start_receiver(
            bind_host="127.0.0.1", stage_dir=str(stage), rollback_dir=rollback_dir
        )
        route = Route([PoolRoute("h20", [Endpoint.parse(address)], 1.5, 5.0)])
        sender = RelaySender(route, SenderConfig(timeout_s=10.0), token=TOKEN)
        try:
            for version, state in enumerate(states, start=1):
                server.fail_loads = version == 3
                report = sender.send_version(version, in_buckets(state, per_bucket=4))
                assert report.committed == ([] if version == 3 else [address])
                if version == 3:  # rolled back to version 2, from wherever it was kept
                    assert server.holds(states[1]) and engine.hex_receiver_status()["version"] == 2
            assert server.holds(states[3]) and engine.get_version() == 4
        finally:
            sender.close()
    finally:
        engine.hex_stop_receiver()
        engine.destroy()
        server.close()
    model = sum(tensor.numel() * tensor.element_size() for tensor in states[0].values())
    return max(held) / model


def test_a_commit_holds_one_version_in_memory_and_rolls_back_from_disk(tmp_path, monkeypatch):
    assert _peak_during_commits(tmp_path, monkeypatch, str(tmp_path / "rollback")) <= 1.5
    assert list((tmp_path / "rollback" / f"areal-hex-uid{os.geteuid()}").iterdir()) == []  # all removed


def test_without_a_rollback_dir_a_commit_holds_two_versions(tmp_path, monkeypatch):
    assert _peak_during_commits(tmp_path, monkeypatch, None) >= 1.9
