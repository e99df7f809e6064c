"""The relay receiver of a RemoteSGLangEngine: stage and verify without touching the server, then commit as pause, load
through SGLang's own disk-update API, version label, resume; the server's TP slicing sees the trainer's tensors."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("areal")

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route  # noqa: E402
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig  # noqa: E402
from areal_hex_plugin.transport.sinks import shard_dim  # noqa: E402
from tests.transport.harness import TOKEN, in_buckets, small_qwen2_state_dict  # noqa: E402
from tests.transport.receiver_engine import ReceiverEngine  # noqa: E402
from tests.transport.sglang_standin import SGLangStandIn  # noqa: E402

pytestmark = pytest.mark.integration


def test_commit_goes_through_sglang_disk_update(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    server = SGLangStandIn(tp_size=2)
    engine = ReceiverEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="t", pause_grace_period=0.0, setup_timeout=30)
    )
    engine.initialize(addr=server.address, train_data_parallel_size=1)
    state = small_qwen2_state_dict(seed=3)
    try:
        endpoint = Endpoint.parse(engine.hex_start_receiver(bind_host="127.0.0.1", stage_dir=str(tmp_path)))
        assert engine.hex_start_receiver(bind_host="127.0.0.1") == str(endpoint)  # idempotent
        sender = RelaySender(Route([PoolRoute("h20", [endpoint], 1.5, 5.0)]), SenderConfig(), token=TOKEN)
        sender.begin(7)
        for bucket in in_buckets(state, per_bucket=4):
            sender.send_bucket(bucket)
        sender.finish(commit=False)
        assert server.events == [] and engine.get_version() == 0  # verified but still serving the old weights
        sender.commit()
        sender.close()
        assert server.events == ["pause", "load v7", "continue"]
        assert server.weight_version == "7"  # the server itself is labelled (SGLang's weight_version)
        assert engine.get_version() == 7
        assert engine.hex_receiver_status()["version"] == 7
        for name, full in state.items():
            dim = shard_dim(name)
            shards = [server.model.shards[rank][name] for rank in range(2)]
            assert torch.equal(torch.cat(shards, dim) if dim is not None else shards[0], full), name
        (private,) = tmp_path.iterdir()  # this user's areal-hex-uid<uid>
        (stage,) = private.iterdir()  # the receiver's own areal-hex-* dir, with its owner lock
        # v7 kept: what SGLang rolls back to (its pages in memory spare for the next version's buckets). The node's
        # keeper moves them off the commit's path, so the listing settles a moment after the commit returns.
        deadline = time.monotonic() + 30
        while (listing := sorted(path.name for path in stage.iterdir())) != [".owner", "spare", "v7"]:
            assert time.monotonic() < deadline, listing
            time.sleep(0.05)
        engine.hex_stop_receiver()
        assert list(private.iterdir()) == []
    finally:
        engine.hex_stop_receiver()
        engine.destroy()
        server.close()


@pytest.mark.slow
def test_receiver_methods_through_upstream_rpc_worker(tmp_path, monkeypatch):
    """The controller's path: a real upstream RPC worker creates the engine by import path and serves /call."""
    import asyncio
    from pathlib import Path

    from areal.api.cli_args import SchedulingSpec
    from areal.api.scheduler_api import Job
    from areal.infra.scheduler.local import LocalScheduler

    repo = Path(__file__).resolve().parents[2]
    server = SGLangStandIn(tp_size=4)
    (tmp_path / "name_resolve").mkdir()
    scheduler = LocalScheduler(
        gpu_devices=[0],
        log_dir=str(tmp_path / "logs"),
        startup_timeout=180,
        experiment_name="hex",
        trial_name="rpc",
        fileroot=str(tmp_path),
        nfs_record_root=str(tmp_path / "name_resolve"),
    )
    spec = SchedulingSpec(
        cpu=1,
        gpu=0,
        mem=1,
        port_count=1,
        cmd="python -m areal.infra.rpc.rpc_server",
        env_vars={"PYTHONPATH": str(repo), "AREAL_HEX_TRANSPORT_TOKEN": TOKEN.decode()},
    )
    state = small_qwen2_state_dict(seed=5)
    try:
        scheduler.create_workers(Job(role="rollout", replicas=1, tasks=[spec]))
        (worker,) = scheduler.get_workers("rollout", timeout=180)
        config = InferenceEngineConfig(experiment_name="hex", trial_name="rpc", pause_grace_period=0.0)

        async def call(method: str, **kwargs):
            return await scheduler.async_call_engine(worker.id, method, engine_name="rollout/0", **kwargs)

        async def set_up() -> str:
            engine_path = "tests.transport.receiver_engine.ReceiverEngine"
            await scheduler.create_engine(worker.id, engine_path, "rollout/0", config=config)
            await call("initialize", addr=server.address, train_data_parallel_size=1)
            return await call("hex_start_receiver", bind_host="127.0.0.1", stage_dir=str(tmp_path / "stage"))

        endpoint = Endpoint.parse(asyncio.run(set_up()))
        sender = RelaySender(Route([PoolRoute("l40s", [endpoint], 1.5, 5.0)]), SenderConfig(), token=TOKEN)
        report = sender.send_version(2, in_buckets(state, per_bucket=6))
        sender.close()
        assert report.committed == [str(endpoint)]
        assert asyncio.run(call("hex_receiver_status"))["version"] == 2
        assert asyncio.run(call("get_version")) == 2
        assert server.events == ["pause", "load v2", "continue"]
        for name, full in state.items():
            dim = shard_dim(name)
            shards = [server.model.shards[rank][name] for rank in range(4)]
            assert torch.equal(torch.cat(shards, dim) if dim is not None else shards[0], full), name
    finally:
        scheduler.delete_workers(None)
        server.close()
