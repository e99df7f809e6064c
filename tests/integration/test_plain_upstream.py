"""A recipe written for plain upstream AReaL runs unchanged with the plugin installed and imported."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("areal")

import areal.trainer.rl_trainer as rl_trainer  # noqa: E402
from areal.api.cli_args import GRPOConfig, load_expr_config  # noqa: E402
from areal.api.scheduler_api import Job  # noqa: E402
from areal.engine.sglang_remote import RemoteSGLangEngine  # noqa: E402
from areal.infra.scheduler.local import LocalScheduler  # noqa: E402

import areal_hex_plugin.areal.trainer  # noqa: E402,F401  (the whole integration imported)
import areal_hex_plugin.driver  # noqa: E402,F401

PLAIN = Path(__file__).parent / "data" / "plain_grpo.yaml"
pytestmark = pytest.mark.integration


def _load(tmp_path: Path) -> GRPOConfig:
    (tmp_path / "nr").mkdir(exist_ok=True)
    config, _ = load_expr_config(
        [
            "--config",
            str(PLAIN),
            f"cluster.fileroot={tmp_path}",
            f"cluster.name_resolve.nfs_record_root={tmp_path}/nr",
        ],
        GRPOConfig,
    )
    return config


def test_upstream_loader_and_trainer_globals_are_untouched(tmp_path: Path) -> None:
    config = _load(tmp_path)
    assert type(config) is GRPOConfig and config.actor.backend == "fsdp:d1"
    assert rl_trainer.RemoteSGLangEngine is RemoteSGLangEngine
    assert rl_trainer.PPOTrainer._init_scheduler.__qualname__ == "PPOTrainer._init_scheduler"


def test_upstream_scheduler_path_starts_a_real_worker(tmp_path: Path) -> None:
    config = _load(tmp_path)
    holder = type("Holder", (), {"config": config})()
    scheduler = rl_trainer.PPOTrainer._init_scheduler(holder)  # upstream's own factory
    assert type(scheduler) is LocalScheduler
    try:
        ids = scheduler.create_workers(
            Job(role="actor", replicas=1, tasks=list(config.actor.scheduling_spec))
        )
        workers = scheduler.get_workers("actor", timeout=120)
        assert ids == ["actor/0"] and workers[0].ip
    finally:
        scheduler.delete_workers()
