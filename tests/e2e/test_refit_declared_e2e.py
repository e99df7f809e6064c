"""Issue 34's two cases through the real driver on ``recipes/ci/tiny.yaml`` (hex_local): a bandwidth the recipe
declares 3x too low is refit from the run and the shares follow; correct factors make no change.

The stand-in servers decode at the true catalog's speed (``tests/e2e/truth-slow.yaml``: the CPU e2e's truth at a
third of its bandwidths, a pace a stand-in keeps beside a loaded pytest); the recipe's ``hex.gpu_catalog`` (the
belief) has CPU-SMALL right and CPU-BIG's ``hbm_tb_per_s`` at a third of the true figure, so the plan solved at start
splits the samples about evenly where the true figures give CPU-BIG's server 3/4. With ``hex.elastic.auto_replan``
(``max_auto_replans=0``: shares change live, nothing restarts) the refits at steps 5 and 10 fit the figure from what
the servers serve and re-share. The test checks that by step 10 the refit's figure is within 25% of the true one and
the live shares within 10% of what the correct catalog plans, and that with the refit off they would not be: the
shares would stay the believed plan's (nothing else moves them on this run), which the planner puts outside that
band. ``benchmarks/refit_declared.py`` runs the refit-off run too.

The second case (issue 34's "correct factors make no change, no flapping") runs the correct catalog with the factors
of this CPU's trainer and weight update as the refit fits them (``MACHINE_FACTORS``): the refits at steps 5 and 10
must suggest nothing, move no share and record no change. Two fixes made it pass: the stand-ins keep the true pace
only to a few percent (a tp2 one on CPU-SMALL ran 5% under it) and a refit's medians of ~8 samples a server
scatter by as much, so a re-share must beat the window's own uncertainty (``refit_replan.change_threshold``; on a
fixed 3% the step-10 refit re-shared 0.75 -> 0.761); and the whole update's time no longer splits between the
types (``costmodel/refit.py``: it left CPU-SMALL's update 4x CPU-BIG's, and the refit model's plan left CPU-SMALL
idle).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("areal")

from areal_hex_plugin.planner import plan_recipe  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402
from tests.e2e.run import PATIENT_PROBES, RECIPE, environment, new_mark, processes_left, run_driver  # noqa: E402
from tests.e2e.sglang_server import TRUTH_ENV  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TIMEOUT_S = 600
STEPS = 11  # refits at steps 5 and 10 (hex.calibration.refit_every: 5, the default)
TRUTH = Path(__file__).with_name("truth-slow.yaml")
FIGURE = "hex/calibration/CPU-BIG/hbm_tb_per_s"
FIGURE_BAND, SHARE_BAND = 0.25, 0.10  # issue 34: the figure within 25%, the shares within 10%, by step 10


def _catalog(big_divided_by: float) -> list[str]:
    """The true catalog's bandwidths as ``hex.gpu_catalog`` overrides, CPU-BIG's divided by ``big_divided_by``."""
    catalog = yaml.safe_load(TRUTH.read_text())["gpu_catalog"]
    return [
        f"hex.gpu_catalog.{gpu}.hbm_tb_per_s={spec['hbm_tb_per_s'] / (big_divided_by if gpu == 'CPU-BIG' else 1)}"
        for gpu, spec in catalog.items()
    ]


# This CPU's trainer and weight update as the refit fits them on this recipe at truth-slow's pace (2026-12-07): the
# train step is faster than CPU-BIG's model gives at any train_mfu in range (so 0.7, its range end), and an update
# takes 0.5-0.9 s while the servers decode (the plan's update window of 1; 0.15-0.18 s every other step at a window
# of 2); the recipe's defaults believe 1.5 s. The refit model's plan is this plan for any update_fixed_s of both
# types alike in 0.15-1.2 s, train_mfu in 0.5-0.7 and servers 5-10% off (planner/refit_replan.decide), so a CI
# machine's own figures move no machine and change no runtime setting; only the shares can follow the servers.
MACHINE_FACTORS = (
    "+hex.calibration.gpu_types.CPU-BIG.train_mfu=0.7",
    *(f"+hex.calibration.gpu_types.{gpu}.update_fixed_s=0.6" for gpu in ("CPU-BIG", "CPU-SMALL")),
)


def _within(shares: dict[str, float], planned: dict[str, float]) -> bool:
    return all(abs(shares.get(pool, 0.0) - share) <= SHARE_BAND * share for pool, share in planned.items())


def test_a_bandwidth_declared_3x_too_low_is_refit_and_the_shares_follow(tmp_path: Path) -> None:
    true = yaml.safe_load(TRUTH.read_text())["gpu_catalog"]["CPU-BIG"]["hbm_tb_per_s"]
    declared = _catalog(3)
    correct = {g.pool: g.share for g in plan_recipe(load_recipe(RECIPE, _catalog(1))).rollout.replicas}
    believed = {g.pool: g.share for g in plan_recipe(load_recipe(RECIPE, declared)).rollout.replicas}
    assert not _within(believed, correct), (believed, correct)  # what the run keeps with the refit off

    env = environment(
        tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2", TRUTH_ENV: str(TRUTH)}
    )
    extra = (*declared, "hex.elastic.auto_replan=true", "hex.elastic.max_auto_replans=0", *PATIENT_PROBES)
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, extra)
    assert run.returncode == 0, run.log[-4000:]
    started_on = {g["pool"]: g["share"] for g in run.plan["rollout"]["replicas"]}
    assert started_on == believed, started_on

    rows = [r for r in run.wandb_history() if any(k.startswith("hex/measured/") for k in r)]
    # A refit's figures are logged with the step after it: (the refit's step, the figure) for the refits to step 10.
    fitted = [(step - 1, r[FIGURE]) for step, r in enumerate(rows, 1) if FIGURE in r and step - 1 <= 10]
    assert fitted, [sorted(r) for r in rows][:2]
    assert abs(fitted[-1][1] / true - 1) <= FIGURE_BAND, (fitted, true)
    reshares = [c for c in run.plan["changes"] if c["kind"] == "reshare"]
    assert reshares and all(c["step"] <= 10 and c["reason"].startswith("refit at step") for c in reshares)
    shares = run.shares_per_pool()
    assert _within(shares, correct), (shares, correct)
    assert processes_left(run.mark, wait_s=30) == []
    summary = {
        "run_s": round(run.seconds, 1),
        "true": true,
        "declared": true / 3,
        "fitted": fitted,
        "believed_shares": believed,
        "correct_shares": correct,
        "live_shares": shares,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


def test_correct_factors_make_no_change(tmp_path: Path) -> None:
    correct = (*_catalog(1), *MACHINE_FACTORS)
    planned = {g.pool: g.share for g in plan_recipe(load_recipe(RECIPE, correct)).rollout.replicas}
    env = environment(
        tmp_path, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2", TRUTH_ENV: str(TRUTH)}
    )
    extra = (*correct, "hex.elastic.auto_replan=true", "hex.elastic.max_auto_replans=0", *PATIENT_PROBES)
    run = run_driver(tmp_path, "hex_local", STEPS, env, TIMEOUT_S, extra)
    assert run.returncode == 0, run.log[-4000:]
    assert {g["pool"]: g["share"] for g in run.plan["rollout"]["replicas"]} == planned

    rows = [r for r in run.wandb_history() if any(k.startswith("hex/measured/") for k in r)]
    decided = [r for r in rows if "hex/replan/suggested" in r]
    said = [{k: r[k] for k in ("hex/replan/gain", "hex/replan/threshold")} for r in decided]
    assert len(decided) == 2, said  # the refits at steps 5 and 10 both decided
    assert not any(r["hex/replan/suggested"] or r["hex/replan/shares_applied"] for r in decided), said
    assert run.plan["changes"] == []
    assert run.shares_per_pool() == pytest.approx(planned, abs=1e-6)
    # A catalog that is right leaves CPU-BIG's hbm_fraction inside its range: the figure is not refit.
    assert not any(FIGURE in r for r in rows)
    assert processes_left(run.mark, wait_s=30) == []
    summary = {"run_s": round(run.seconds, 1), "planned_shares": planned, "decisions": said}
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
