"""hex/* metrics and the plan through upstream's REAL StatsLogger with wandb offline (upstream owns the run)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from areal_hex_plugin.areal.metrics import step_metrics
from tests.integration.plans import two_type_plan

STEP = {
    "timeperf/rollout": 7.0,
    "timeperf/train_step": 5.5,
    "timeperf/update_weights": 1.5,
    "ppo_actor/n_valid_tokens": 20_000.0,
    "hex/rollout/big/samples": 30.0,
    "hex/rollout/small/samples": 10.0,
}


def test_step_metrics_compare_prediction_and_measurement() -> None:
    m = step_metrics(two_type_plan(), STEP, step_s=10.0)
    assert m["hex/measured/rollout_s"] == 7.0 and m["hex/predicted/rollout_s"] == 8.0
    assert m["hex/measured/tokens_per_s"] == pytest.approx(2000.0)
    assert m["hex/measured/tokens_per_dollar"] == pytest.approx(2000.0 * 3600 / 10.0)
    assert m["hex/pool/big/tokens_per_s"] == pytest.approx(1500.0)
    assert m["hex/pool/small/tokens_per_s"] == pytest.approx(500.0)


def test_the_train_phase_is_the_log_prob_passes_and_the_update_as_upstream_times_them() -> None:
    """Upstream times the log-prob passes (``recompute_logp``, ``ref_logp``) apart from the update
    (``train_step``); the model's train time holds all three, so the measured train time is their sum and each
    phase is logged beside the plan's share of it."""
    plan = two_type_plan()
    plan = replace(plan, predicted=replace(plan.predicted, train_time_s=6.0, train_logp_s=1.5))
    data = {**STEP, "timeperf/recompute_logp": 1.25, "timeperf/ref_logp": 0.5}
    m = step_metrics(plan, data, step_s=10.0)
    assert m["hex/measured/train_s"] == pytest.approx(7.25)
    assert m["hex/measured/logp_s"] == pytest.approx(1.75)
    assert m["hex/measured/update_s"] == 5.5
    assert m["hex/predicted/logp_s"] == 1.5 and m["hex/predicted/update_s"] == 4.5
    # A run without the pass (no decoupled loss, no recompute): the update is the whole train phase.
    m = step_metrics(plan, STEP, step_s=10.0)
    assert m["hex/measured/train_s"] == 5.5 and m["hex/measured/logp_s"] == 0.0


def test_without_token_counts_only_predictions_and_timings_are_logged() -> None:
    m = step_metrics(two_type_plan(), {"timeperf/rollout": 3.0}, step_s=None)
    assert "hex/measured/tokens_per_s" not in m and m["hex/measured/rollout_s"] == 3.0


@pytest.mark.integration
def test_stats_logger_with_wandb_offline_gets_hex_metrics_and_plan(tmp_path: Path) -> None:
    pytest.importorskip("areal")
    import wandb
    from areal.api.cli_args import GRPOConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.utils.stats_logger import StatsLogger

    from areal_hex_plugin.areal.metrics import HexStatsLog

    config = GRPOConfig(experiment_name="hex-test", trial_name="wandb")
    config.stats_logger.experiment_name, config.stats_logger.trial_name = "hex-test", "wandb"
    config.stats_logger.fileroot = str(tmp_path)
    config.stats_logger.wandb.mode = "offline"
    inner = StatsLogger(config, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=4))
    try:
        log = HexStatsLog(inner, two_type_plan())
        assert wandb.run is not None and wandb.run.config["hex_plan"]["model"] == "Qwen2.5-0.5B"
        log.on_step.append(
            lambda data, step: {"hex/calibration/CPU-BIG/hbm_fraction": data["timeperf/train_step"] / 10}
        )
        log.commit(0, 0, 0, dict(STEP))
        wandb.run.log({}, commit=True)  # flush the step upstream logged, so the run summary holds it
        summary = dict(wandb.run.summary)
        run_dir = Path(wandb.run.dir).parent
    finally:
        inner.close()
    assert summary["hex/measured/rollout_s"] == 7.0
    assert summary["hex/calibration/CPU-BIG/hbm_fraction"] == 0.55  # what an on_step hook (the refit) adds
    assert summary["hex/predicted/tokens_per_s"] == 1000.0
    assert summary["hex/measured/tokens_per_s"] > 0 and "hex/pool/small/tokens_per_s" in summary
    table = json.loads(next(run_dir.glob("files/media/table/hex/plan_*.table.json")).read_text())
    assert [row[:4] for row in table["data"]][0] == ["big", "big-0", "H100", "train"] and len(
        table["data"]
    ) == 4
    assert list(run_dir.glob("*.wandb"))  # upstream's wandb.init wrote the offline run
