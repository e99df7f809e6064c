"""Pipeline stages as senders (gloo processes standing in for Megatron's stage heads): each stage sends the layers
it holds through the same train-side seams as HexMegatronRelayActor, the replicas assemble the stages' parts
bit-exactly; a stage whose part cannot reach any replica fails the version on every stage (after the repair rounds
tried each replica as the relay) and no replica switches."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket

import pytest
import torch

from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
from tests.transport.harness import ReplicaFleet, small_qwen2_state_dict
from tests.transport.stage_rank import run_configure, run_stage, stage_tensors
from tests.transport.test_relay_transfer import _assert_holds

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAYERS = (2, 1, 1)  # the plan's layer count of each stage


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(tmp_path, route: dict, state: dict, cut_off: int = -1) -> list[dict]:
    context = mp.get_context("spawn")
    port, out, model = _free_port(), tmp_path / "outcome", tmp_path / "model.pt"
    torch.save(state, model)
    stages = [
        context.Process(target=run_stage, args=(rank, LAYERS, port, route, str(model), str(out), cut_off))
        for rank in range(len(LAYERS))
    ]
    try:
        for process in stages:
            process.start()
        for process in stages:
            process.join(timeout=180)
        assert [process.exitcode for process in stages] == [0] * len(LAYERS)
    finally:
        for process in stages:
            if process.is_alive():
                process.kill()
    return [json.loads((tmp_path / f"outcome.{rank}").read_text()) for rank in range(len(LAYERS))]


def test_every_stage_sends_its_layers_and_the_replicas_hold_the_whole_model(tmp_path):
    state = small_qwen2_state_dict(seed=5, layers=sum(LAYERS))
    with ReplicaFleet(tmp_path) as fleet:
        replicas = fleet.start([1, 2])
        route = Route([PoolRoute("h20", [r.endpoint for r in replicas], 1.5, 5.0)]).to_dict()
        outcomes = _run(tmp_path, route, state)
        for replica in replicas:
            _assert_holds(replica, state, 1)
    assert [outcome["error"] for outcome in outcomes] == ["", "", ""]
    report = outcomes[0]["report"]
    assert report["committed"] == [str(r.endpoint) for r in replicas] and report["failed"] == {}
    stage_bytes = [
        sum(t.numel() * t.element_size() for _, t in stage_tensors(state, LAYERS, stage))
        for stage in range(3)
    ]
    assert report["part_bytes"] == stage_bytes and sum(stage_bytes) == report["bytes"]


def test_a_stage_that_cannot_reach_the_pool_fails_the_version_everywhere(tmp_path):
    with ReplicaFleet(tmp_path) as fleet:
        replicas = fleet.start([1, 1])
        route = Route([PoolRoute("h20", [r.endpoint for r in replicas], 1.5, 5.0)]).to_dict()
        outcomes = _run(tmp_path, route, small_qwen2_state_dict(seed=5, layers=sum(LAYERS)), cut_off=2)
        held = [replica.committed()["version"] for replica in replicas]
    error = outcomes[0]["error"]
    assert "data link from the sender of part 2" in error and "no route to the pool" in error
    assert "no replica left in the pool" in error
    assert all("the weight update failed on rank 0" in outcome["error"] for outcome in outcomes[1:])
    assert held == [-1, -1]


def test_a_stage_without_the_token_is_refused_when_the_route_is_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("AREAL_HEX_TRANSPORT_TOKEN", raising=False)  # the spawned stages set their own
    route = Route([PoolRoute("h20", [Endpoint("127.0.0.1", _free_port())], 1.5, 5.0)]).to_dict()
    context = mp.get_context("spawn")
    port, out = _free_port(), tmp_path / "configured"
    stages = [context.Process(target=run_configure, args=(r, 2, port, route, str(out), 1)) for r in range(2)]
    try:
        for process in stages:
            process.start()
        for process in stages:
            process.join(timeout=120)
        assert [process.exitcode for process in stages] == [0, 0]
    finally:
        for process in stages:
            if process.is_alive():
                process.kill()
    first, second = ((tmp_path / f"configured.{rank}").read_text() for rank in range(2))
    assert first.startswith("TransportError: hex transport: a sending rank cannot send (rank 1: ")
    assert "AREAL_HEX_TRANSPORT_TOKEN" in first and second == "configured"
