"""HexPPOTrainer._init_scheduler: the seam upstream calls before parsing any backend string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.alloc_mode import ModelAllocation  # noqa: E402
from areal.utils.stats_logger import StatsLogger  # noqa: E402

from areal_hex_plugin.areal.config import load_hex_config  # noqa: E402
from areal_hex_plugin.areal.placement import node_local  # noqa: E402
from areal_hex_plugin.areal.schedulers.local import HexLocalScheduler  # noqa: E402
from areal_hex_plugin.areal.trainer import PLAN_FILE, HexPPOTrainer  # noqa: E402
from areal_hex_plugin.scheduler import plan_recipe  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/paper/7b.yaml"


@pytest.mark.integration
def test_init_scheduler_rewrites_config_saves_plan_and_builds_the_hex_scheduler(tmp_path: Path) -> None:
    (tmp_path / "nr").mkdir()
    overrides = [f"cluster.fileroot={tmp_path}", f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}"]
    config, _ = load_hex_config(["--config", str(RECIPE), *overrides])
    plan = plan_recipe(load_recipe(RECIPE, overrides))
    built = []

    def make_scheduler():
        from areal_hex_plugin.areal.placement import placement_from_plan

        built.append(HexLocalScheduler(node_local(placement_from_plan(plan), plan), exp_config=config))
        return built[-1]

    # Everything PPOTrainer.__init__ does before this call needs a tokenizer download; the seam itself does not.
    trainer = HexPPOTrainer.__new__(HexPPOTrainer)
    trainer.config, trainer.hex_plan, trainer._make_scheduler = config, plan, make_scheduler
    scheduler = trainer._init_scheduler()

    assert scheduler is built[0]
    actor = ModelAllocation.from_str(config.actor.backend)
    rollout = ModelAllocation.from_str(config.rollout.backend)
    assert actor.parallel.world_size == sum(plan.train.gpus.values())
    assert rollout.parallel.dp_size == sum(g.count for g in plan.rollout.replicas)
    assert config.rollout.max_head_offpolicyness == plan.staleness.max_head_offpolicyness
    assert config.rollout.max_concurrent_rollouts == plan.staleness.max_concurrent_rollouts
    saved = Path(StatsLogger.get_log_path(config.stats_logger))
    assert (saved / "config.yaml").exists()  # upstream's, written by load_expr_config
    assert json.loads((saved / PLAN_FILE).read_text())["model"] == plan.model
