"""End to end on CPU: a real 2-rank upstream FSDP actor (gloo) gathers every tensor with upstream's own code,
each rank of HexFSDPPPOActor sends its own share through the relay, and a RelayReceiverMixin engine assembles the
parts and commits the version into an SGLang stand-in with TP 2, bit-exact; a part that stays corrupt however often
its rank re-sends it is never committed."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time

import pytest
import torch

pytest.importorskip("areal")

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route  # noqa: E402
from areal_hex_plugin.transport.sinks import shard_dim  # noqa: E402
from tests.transport.fsdp_rank import run_rank, run_rank_expecting_failure  # noqa: E402
from tests.transport.harness import TOKEN, small_qwen2  # noqa: E402
from tests.transport.receiver_engine import ReceiverEngine  # noqa: E402
from tests.transport.sglang_standin import SGLangStandIn  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _save_model(path) -> dict[str, torch.Tensor]:
    model = small_qwen2(seed=11, kv_heads=2)
    model.save_pretrained(path)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def serving_engine(tp_size: int = 2) -> tuple[SGLangStandIn, ReceiverEngine]:
    """An SGLang stand-in with TP ``tp_size`` and a rollout engine with the receiver methods on it."""
    server = SGLangStandIn(tp_size=tp_size)
    engine = ReceiverEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="t", pause_grace_period=0)
    )
    engine.initialize(addr=server.address, train_data_parallel_size=1)
    return server, engine


def replica(tmp_path, tp_size: int = 2) -> tuple[SGLangStandIn, ReceiverEngine, Endpoint]:
    """:func:`serving_engine` with its receiver started: the server, the engine, its endpoint."""
    server, engine = serving_engine(tp_size)
    endpoint = Endpoint.parse(
        engine.hex_start_receiver(bind_host="127.0.0.1", stage_dir=str(tmp_path / "stage"))
    )
    return server, engine, endpoint


def _close(server: SGLangStandIn, engine: ReceiverEngine | None = None) -> None:
    if engine is not None:
        engine.hex_stop_receiver()
        engine.destroy()
    server.close()


def _run_ranks(target, *args, timeout_s: float, last=lambda rank: ()) -> list[int | None]:
    """``target(rank, 2, port, *args, *last(rank))`` in two spawned processes (the actor's 2 gloo ranks), within
    ``timeout_s`` together: their exit codes (a rank still running then is killed)."""
    context = mp.get_context("spawn")
    port = _free_port()
    ranks = [context.Process(target=target, args=(rank, 2, port, *args, *last(rank))) for rank in range(2)]
    try:
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout_s
        for process in ranks:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
        return [process.exitcode for process in ranks]
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()


def assert_server_holds(server: SGLangStandIn, expected: dict[str, torch.Tensor]) -> None:
    """Bit-exact: the server's TP 2 shards join into every expected tensor."""
    assert set(server.model.shards[0]) == set(expected)
    for name, full in expected.items():
        dim = shard_dim(name)
        shards = [server.model.shards[rank][name] for rank in range(2)]
        assert torch.equal(torch.cat(shards, dim) if dim is not None else shards[0], full), name


def test_fsdp_actor_updates_a_rollout_replica(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    expected = _save_model(tmp_path / "model")
    server, engine, endpoint = replica(tmp_path)
    route = Route([PoolRoute("h20", [endpoint], 1.5, 5.0)]).to_dict()
    out = tmp_path / "report.json"
    try:
        codes = _run_ranks(run_rank, str(tmp_path / "model"), server.address, route, str(out), timeout_s=240)
        assert codes == [0, 0]
    finally:
        _close(server, engine)
    report = json.loads(out.read_text())
    assert report["version"] == 3 and report["committed"] == [str(endpoint)] and report["failed"] == {}
    # Each rank sent about half of the model: no one rank's NIC carries it all.
    assert len(report["part_bytes"]) == 2 and sum(report["part_bytes"]) == report["bytes"]
    assert all(0.35 * report["bytes"] < sent < 0.65 * report["bytes"] for sent in report["part_bytes"])
    assert engine.get_version() == 3
    # The trainer's own pause/resume around the stream, then the replica's atomic commit.
    assert server.events == ["pause", "continue", "pause", "load v3", "continue"]
    assert_server_holds(server, expected)


def test_every_rank_fails_together_when_rank_0_cannot_begin(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    _save_model(tmp_path / "model")
    server = SGLangStandIn(tp_size=1)
    unreachable = Endpoint("127.0.0.1", _free_port())  # nothing listens there
    route = Route([PoolRoute("h20", [unreachable], 1.5, 5.0)]).to_dict()
    out = tmp_path / "outcome"
    try:
        args = (str(tmp_path / "model"), server.address, route, str(out))
        assert _run_ranks(run_rank_expecting_failure, *args, timeout_s=120) == [0, 0]
    finally:
        _close(server)
    outcomes = [(tmp_path / f"outcome.{rank}").read_text() for rank in range(2)]
    assert outcomes[0].startswith("TransportError") and f"cannot reach receiver {unreachable}" in outcomes[0]
    assert "rank 0 could not begin the weight update" in outcomes[1]
    assert f"cannot reach receiver {unreachable}" in outcomes[1]
    assert "pause" not in server.events  # upstream's update never started


def test_every_rank_fails_together_when_rank_0_cannot_pause_generation(tmp_path, monkeypatch):
    """Rank 0 pauses the rollout for every rank; a pause that fails there fails the update on every rank (the
    others waited at a barrier for rank 0, which had left: the run hung)."""
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    _save_model(tmp_path / "model")
    server, engine, endpoint = replica(tmp_path, tp_size=1)
    server.app.view_functions["pause"] = lambda: ("the server is gone (injected)", 500)
    route = Route([PoolRoute("h20", [endpoint], 1.5, 5.0)]).to_dict()
    out = tmp_path / "outcome"
    try:
        args = (str(tmp_path / "model"), server.address, route, str(out))
        assert _run_ranks(run_rank_expecting_failure, *args, timeout_s=120) == [0, 0]
    finally:
        _close(server, engine)
    outcomes = [(tmp_path / f"outcome.{rank}").read_text() for rank in range(2)]
    assert outcomes[0] != "no error" and "rank 0 could not pause generation" in outcomes[1], outcomes
    assert engine.get_version() == 0 and not any(event.startswith("load") for event in server.events)


def test_a_corrupt_part_from_one_rank_is_never_committed(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    _save_model(tmp_path / "model")
    server, engine, endpoint = replica(tmp_path, tp_size=1)
    route = Route([PoolRoute("h20", [endpoint], 1.5, 5.0)]).to_dict()
    out = tmp_path / "outcome"
    try:
        args = (str(tmp_path / "model"), server.address, route, str(out))
        codes = _run_ranks(run_rank_expecting_failure, *args, timeout_s=240, last=lambda rank: (rank == 1,))
        assert codes == [0, 0]
    finally:
        _close(server, engine)
    outcomes = [(tmp_path / f"outcome.{rank}").read_text() for rank in range(2)]
    # Rank 1 re-sends the bucket (repair rounds) until the replica is given up: nothing corrupt is committed.
    assert "arrived corrupted 4 times" in outcomes[0] and "no replica committed version 3" in outcomes[0]
    assert "the weight update failed on rank 0" in outcomes[1] and "arrived corrupted" in outcomes[1]
    assert engine.get_version() == 0 and not any(event.startswith("load") for event in server.events)
