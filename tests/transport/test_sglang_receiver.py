"""HexRemoteSGLangEngine's receiver: stage and verify without touching the server, then commit as pause, load
through SGLang's own disk-update API, version label, resume; the server's TP slicing sees the trainer's tensors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("areal")

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from areal_hex_plugin.transport import HexRemoteSGLangEngine  # noqa: E402
from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route  # noqa: E402
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig  # noqa: E402
from areal_hex_plugin.transport.sinks import shard_dim  # noqa: E402
from tests.transport.harness import TOKEN, in_buckets, small_qwen2_state_dict  # noqa: E402
from tests.transport.sglang_standin import SGLangStandIn  # noqa: E402

pytestmark = pytest.mark.integration


def test_commit_goes_through_sglang_disk_update(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    server = SGLangStandIn(tp_size=2)
    engine = HexRemoteSGLangEngine(
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
        assert engine.get_version() == 7
        assert engine.hex_receiver_status()["version"] == 7
        for name, full in state.items():
            dim = shard_dim(name)
            shards = [server.model.shards[rank][name] for rank in range(2)]
            assert torch.equal(torch.cat(shards, dim) if dim is not None else shards[0], full), name
        assert sorted(p.name for p in tmp_path.iterdir() for p in p.iterdir()) == ["v7"]
    finally:
        engine.hex_stop_receiver()
        engine.destroy()
        server.close()
