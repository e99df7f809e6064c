"""Windows that do not drain: a step overlaps its longest sample with the next steps as far as admission's room
lets it.

Found (issue 23, item 1): the planner charged every window its longest sample, also where upstream's loop overlaps
it. AReaL's released runtime on 24 H800 (7B, one batch admitted, weights every step, eta 8) was planned at 455 s a
step where the simulator of upstream's loop trained every 277 s. With room for a whole batch beyond the rollouts in
flight, every rollout that ends during training is replaced and a step takes its samples at the fleet's rate; with
less (eta 1 there), the rollouts that end during training beyond the room are not replaced, and the step waits for
what its batch then lacks (``costmodel.model.tight_step_s``): the simulator found 366 s against 455 planned.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from areal_hex_plugin.costmodel.model import admission_room, tight_step_s
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.sim.agreement import TOLERANCE
from areal_hex_plugin.sim.baselines import homogeneous
from areal_hex_plugin.sim.engine import simulate
from areal_hex_plugin.sim.inputs import sim_spec
from areal_hex_plugin.sim.reproduce import paper_request
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

RUN = json.loads((REPO / "recipes/paper/baselines.json").read_text())["models"]["DeepSeek-R1-Distill-Qwen-7B"]


def _areal_on_h800(eta: int):
    """AReaL's released runtime on the paper's 24 H800 for 7B (the measured run's setting) at ``eta``, under
    upstream 1.0.4's loop (the one runtime of every command, the fit's included)."""
    recipe = load_recipe(REPO / "recipes/paper/7b.yaml", [])
    setting = homogeneous(recipe, "H800-PCIe", 24, RUN["h800"], [1, 1])
    rl = dataclasses.replace(setting.workload.rl, max_head_offpolicyness=eta)
    setting = dataclasses.replace(setting, workload=dataclasses.replace(setting.workload, rl=rl))
    plan = plan_recipe(setting, paper_request(setting))
    return plan, simulate(sim_spec(setting, plan), steps=30, seed=0)


def test_admission_room_and_the_wait_of_a_tight_step():
    # The room after a window's last consumed batch: eta + 1 batches less the window's and those in flight.
    assert admission_room(8, 1, 1) == 7 and admission_room(1, 1, 1) == 0 and admission_room(8, 6, 2.5) == 0.5
    # Worked by hand: g = 100 s a batch at full occupancy, 40 s of training.
    # Room for a whole batch: the 0.4 batch that ends during training is replaced, the step is g = 100 s.
    assert tight_step_s(100.0, 40.0, 1.0, 1.0) == pytest.approx(100.0)
    # No room, 1 batch in flight: it decays unreplaced with a mean residence of 1 x 100 s, so 1 - e^-0.4 = 0.32968
    # of it ends in the 40 s; the missing 0.67032 comes at full speed, 67.032 s: 40 + 67.032 = 107.032 s.
    assert tight_step_s(100.0, 40.0, 1.0, 0.0) == pytest.approx(107.032, abs=1e-3)
    # Room 0.25, 2 batches in flight: the first 25 s end 0.25 batch, all replaced; the 15 s left decay the 2
    # batches with a residence of 2 x 100 s: 2 (1 - e^-0.075) = 0.144513 end; 1 - 0.25 - 0.144513 = 0.605487 of
    # the batch is missing, 60.549 s at full speed: 40 + 60.549 = 100.549 s.
    assert tight_step_s(100.0, 40.0, 2.0, 0.25) == pytest.approx(100.549, abs=1e-3)
    # A long training step leaves almost nothing to wait for; more room, less wait.
    assert tight_step_s(100.0, 1000.0, 1.0, 0.0) == pytest.approx(1000.0, rel=1e-4)
    assert tight_step_s(100.0, 40.0, 1.0, 0.3) < tight_step_s(100.0, 40.0, 1.0, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("eta", [1, 8])
def test_areal_runtime_is_planned_as_the_loop_runs_it(eta):
    plan, result = _areal_on_h800(eta)
    # eta 1: 381 s planned, 406 s simulated; eta 8: 329 s planned, 368 s simulated (one batch admitted, so the
    # 16 replicas hold 11 sequences each; the loop's replicas idle once their queues run dry in each step's tail,
    # which the plan does not see). An earlier 276 s at eta 8, planned and simulated alike, was the recipe's
    # placeholder allocation admitting 467 rollouts (test_one_runtime.py's admission test).
    limit = {1: 2, 8: 2.5}[eta] * TOLERANCE
    assert abs(result.step_time_s / plan.predicted.step_time_s - 1) <= limit
    if eta == 1:
        # The measured run's own setting (its eta fitted 1; rollout-bound): 404.5 s of rollout and 14.8 s of
        # weight sync. At eta 8 the same deployment overlaps more: no measurement to compare with.
        measured = RUN["h800"]["rollout_s"] + RUN["h800"]["weight_sync_s"]
        assert plan.predicted.step_time_s == pytest.approx(measured, rel=0.15)
