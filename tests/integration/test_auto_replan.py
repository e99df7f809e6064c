"""Re-plans a run applies on its own at a recover checkpoint (areal/auto_replan.py): the refit loop hands over a
suggestion that moves machines once, the trainer's checkpoint is forced through upstream's own recover handler, the
new plan records the change with its reason, the driver's arguments go on on it, and the bounds (recover off, the
trial's count) leave it a suggestion."""

from __future__ import annotations

import json
import logging.handlers
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.cli_args import RecoverConfig  # noqa: E402
from areal.api.io_struct import FinetuneSpec  # noqa: E402
from areal.utils.recover import RecoverHandler  # noqa: E402

from areal_hex_plugin.areal import refit_loop  # noqa: E402
from areal_hex_plugin.areal.auto_replan import (  # noqa: E402
    AUTO_KIND,
    applied_plan,
    applied_so_far,
    forced_dump,
    restart_args,
    why_not,
)
from areal_hex_plugin.areal.refit_loop import REPLAN_FILE, OnlineRefit  # noqa: E402
from areal_hex_plugin.costmodel import CostModel  # noqa: E402
from areal_hex_plugin.plan import HexPlan  # noqa: E402
from areal_hex_plugin.planner import plan_recipe  # noqa: E402
from areal_hex_plugin.sim.online import factors_off  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.integration.test_refit_loop import _true_figures  # noqa: E402

TINY = REPO / "recipes" / "ci" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny():
    recipe = load_recipe(TINY, [])
    # Every factor of CPU-SMALL half what the recipe believes: its servers' decode speed says so (the whole update's
    # time cannot say which type's update is slower; both move alike), and the refit model's plan leaves it idle.
    return recipe, plan_recipe(recipe), factors_off(recipe.calibration, "CPU-SMALL", -0.5)


def _run(recipe, plan, truth, folder: Path, worker, **kw) -> tuple[OnlineRefit, list[dict], str]:
    """Five steps of ``plan`` served at ``truth``'s speeds, a refit at step 5: the loop, each step's metrics
    (the refit's at the sixth) and what it logged."""
    served, data = _true_figures(recipe, plan, CostModel(recipe.cluster, recipe.workload, truth))
    shapes = [(g.pool, g.tp, g.pp) for g in plan.rollout.replicas for _ in range(g.count)]
    loop = OnlineRefit(
        recipe, lambda: plan, lambda: shapes, lambda: served, folder=folder, run="t1", every=5, threshold=0.03,
        argv=["--config", str(TINY)], worker=worker, **kw,
    )  # fmt: skip
    said = logging.handlers.BufferingHandler(100)
    refit_loop.logger.addHandler(said)
    try:
        logged = [loop.on_step(data) for _ in range(5)]
        loop.join()
        logged.append(loop.on_step(data))
    finally:
        refit_loop.logger.removeHandler(said)
    return loop, logged, "\n".join(r.getMessage() for r in said.buffer)


def test_a_suggestion_that_moves_machines_is_handed_to_the_checkpoint_once(
    tiny, refit_worker, tmp_path
) -> None:
    """CPU-SMALL half as fast as believed: the refit model's plan leaves small-0 idle (a role change; big-2
    generates alone). With ``no_restart=None`` the loop hands the decision over once, for the trainer's
    next checkpoint, and says so."""
    recipe, plan, truth = tiny
    loop, logged, text = _run(recipe, plan, truth, tmp_path, refit_worker, no_restart=None)
    assert logged[-1]["hex/replan/suggested"] == 1.0 and logged[-1]["hex/replan/restart"] == 1.0
    decision, step = loop.take_restart()
    assert step == 5 and {d.host: d.after for d in decision.diff} == {"small-0": "idle"}
    assert loop.take_restart() is None  # once: the run stops at that checkpoint
    assert "applies it at the next recover checkpoint" in text and "not applied live" not in text


def test_a_suggestion_the_run_applies_live_is_not_handed_to_the_checkpoint(
    tiny, refit_worker, tmp_path
) -> None:
    """Where the run can apply it live (``elastic/relayout.py``) the loop does so, from its own thread, once the
    shares were re-solved under the refit model; where the live path says why not, the checkpoint takes it."""
    recipe, plan, truth = tiny
    calls = []

    def live(decision, step):
        calls.append(("live", step, sorted(d.host for d in decision.diff)))
        return None

    def apply_shares(calibration, reason, min_gain):
        calls.append(("shares", reason))
        return True

    loop, logged, text = _run(
        recipe, plan, truth, tmp_path, refit_worker, no_restart=None, live=live, apply_shares=apply_shares
    )
    assert calls == [
        ("shares", "refit at step 5: shares re-solved under the refit model"),
        ("live", 5, ["small-0"]),
    ]
    assert logged[-1]["hex/replan/live"] == 1.0 and logged[-1]["hex/replan/restart"] == 0.0
    assert loop.take_restart() is None and "applies it live, one machine at a time" in text

    def refused(decision, step):
        return "small-0 changes role (rollout tp2pp1 x1 -> train stage 0 dp3 tp1)"

    loop, logged, text = _run(recipe, plan, truth, tmp_path, refit_worker, no_restart=None, live=refused)
    assert logged[-1]["hex/replan/live"] == 0.0 and logged[-1]["hex/replan/restart"] == 1.0
    assert "is not applied live: small-0 changes role" in text and loop.take_restart()[1] == 5


def test_without_restarts_the_same_suggestion_says_why_and_prints_the_command(
    tiny, refit_worker, tmp_path
) -> None:
    recipe, plan, truth = tiny
    why = "recover.mode is off: without recover checkpoints the run would go on from step 0"
    loop, logged, text = _run(recipe, plan, truth, tmp_path, refit_worker, no_restart=why)
    assert logged[-1]["hex/replan/suggested"] == 1.0 and logged[-1]["hex/replan/restart"] == 0.0
    assert loop.take_restart() is None
    assert f"not applied live ({why})" in text and f"hex.plan_path={tmp_path / REPLAN_FILE}" in text


def test_the_applied_plan_records_the_change_and_counts_toward_the_bound(
    tiny, refit_worker, tmp_path
) -> None:
    recipe, plan, truth = tiny
    loop, _, _ = _run(recipe, plan, truth, tmp_path, refit_worker, no_restart=None)
    decision, refit_step = loop.take_restart()
    running = replace(plan, changes=[*plan.changes])
    new = applied_plan(running, decision, refit_step, step=6, most=1)
    change = new.changes[-1]
    assert change.kind == AUTO_KIND and change.hosts == ["small-0"] and change.step == 6
    assert change.reason.startswith("refit at step 5: the refit model plans ")
    assert "small-0: rollout tp2pp1 x1 -> idle" in change.reason
    assert (
        "recover checkpoint after step 7 (global step 6)" in change.reason
        and "automatic re-plan 1 of at most 1" in change.reason
    )
    assert {g.pool for g in new.rollout.replicas} == {"big"}
    # Written and read back as a plan (hex.plan_path of the restarted run), its change with it.
    path = new.save(tmp_path / "hex_plan.auto1.json")
    assert HexPlan.from_dict(json.loads(Path(path).read_text())).changes[-1] == change
    assert applied_so_far(plan) == 0 and applied_so_far(new) == 1
    # The bound: this trial's count against max_auto_replans; recover off; auto_replan off.
    assert why_not(True, 1, "auto", plan) is None and why_not(True, 2, "on", new) is None
    assert "max_auto_replans=1" in why_not(True, 1, "auto", new)
    assert "only suggested" in why_not(True, 0, "auto", plan)
    for mode in ("off", "disabled"):
        assert why_not(True, 1, mode, plan).startswith(f"recover.mode is {mode}: ")
    assert why_not(False, 1, "auto", plan) == "hex.elastic.auto_replan is false"


def test_the_restart_goes_on_with_the_same_arguments_on_the_new_plan_and_profile() -> None:
    argv = ["--config", "r.yaml", "hex.plan_path=old.json", "++hex.calibration.profile=p0.json", "seed=3"]
    assert restart_args(argv, "new.json", "p1.json") == [
        "--config", "r.yaml", "seed=3", "hex.plan_path=new.json", "hex.calibration.profile=p1.json",
    ]  # fmt: skip


def test_a_forced_dump_passes_upstreams_frequency_check_and_still_counts_the_step() -> None:
    """Upstream's own RecoverHandler with no checkpoint frequency: its check says no; forced, it says yes, the
    step still counted, and the handler's own control is back afterwards."""
    config = RecoverConfig(mode="on", freq_epochs=None, freq_steps=None, freq_secs=None)
    handler = RecoverHandler(config, FinetuneSpec(total_train_epochs=1, dataset_size=40, train_batch_size=4))
    inner = handler.freq_ctl
    assert not handler.freq_ctl.check(epochs=0, steps=1)
    with forced_dump(handler):
        assert handler.freq_ctl.check(epochs=0, steps=1)
        assert handler.freq_ctl.state_dict() == inner.state_dict()
    assert handler.freq_ctl is inner and not handler.freq_ctl.check(epochs=0, steps=1)
    assert inner.state_dict()["step"]["steps"] == 3


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            [],
            "auto_replan: a re-plan that only starts, stops or re-lays out rollout servers applies live, one "
            "machine at a time (the servers left keep 50% of the rollout capacity); any other applies at the next "
            "recover checkpoint (the driver goes on from it on the new plan) (at most 1 a trial)",
        ),
        (
            ["hex.elastic.live_relayout=false"],
            "auto_replan: a re-plan that moves machines applies at the next recover checkpoint (the driver goes on "
            "from it on the new plan) (at most 1 a trial; not live: hex.elastic.live_relayout is false)",
        ),
        (
            ["recover.mode=off", "hex.elastic.min_rollout_capacity=0.7"],
            "auto_replan: a re-plan that only starts, stops or re-lays out rollout servers applies live, one "
            "machine at a time (the servers left keep 70% of the rollout capacity); any other is only suggested: "
            "recover.mode is off: without recover checkpoints",
        ),
        (
            ["recover.mode=off", "hex.transport=upstream"],
            "auto_replan: a re-plan that moves machines is only suggested: recover.mode is off: without recover "
            "checkpoints",
        ),
        (["hex.elastic.max_auto_replans=0"], "auto_replan: only suggested: this trial applied 0 re-plans"),
        (  # the spent budget is said, whatever else would stop a restart
            ["hex.elastic.max_auto_replans=0", "recover.mode=off"],
            "auto_replan: only suggested: this trial applied 0 re-plans",
        ),
    ],
)
def test_the_preflight_says_whether_re_plans_apply_live_or_at_a_checkpoint(
    overrides, said, tmp_path, transport_token
) -> None:
    """``areal-hex check`` and the driver's pre-flight say what auto_replan will do with a re-plan that moves
    machines, before anything starts: live, at a checkpoint or only suggested (recover off is said at once, not
    found at step 0 of a restart)."""
    from areal_hex_plugin.areal.preflight import preflight

    base = [f"cluster.fileroot={tmp_path / 'exp'}", "hex.elastic.auto_replan=true"]
    passed = preflight(str(TINY), [*base, *overrides], offline=True).passed
    assert any(line.startswith(said) for line in passed), passed
