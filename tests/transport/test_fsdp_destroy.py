"""HexFSDPPPOActor.destroy: upstream's worker destroys its engines again at SIGTERM after the controller did; that
second destroy returns at once instead of collecting the whole heap twice more (past the worker's grace)."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("areal")

from areal.api.cli_args import PPOActorConfig  # noqa: E402

from areal_hex_plugin.transport.fsdp_adapter import HexFSDPPPOActor  # noqa: E402
from tests.transport.harness import small_qwen2  # noqa: E402


def test_a_second_destroy_collects_nothing(tmp_path, monkeypatch):
    small_qwen2(seed=1, kv_heads=2).save_pretrained(tmp_path)
    actor = HexFSDPPPOActor(PPOActorConfig(experiment_name="e", trial_name="t", path=str(tmp_path)))
    collections = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(1) or collect(*args))
    actor.destroy()
    first = len(collections)
    actor.destroy()
    assert first > 0
    assert len(collections) == first
