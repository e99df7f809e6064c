"""What a ranking hangs on (``planner/sensitivity.py``): held plans re-score to the planner's figures, the
elasticities have the sign and size the step's make-up gives them, the length-distribution changes move one
figure each, and the flip check warns on a tie and not on a clear choice."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import jsonschema
import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel import CostModel, Efficiency
from areal_hex_plugin.costmodel.calibration import FACTORS, Calibration
from areal_hex_plugin.planner import PlanRequest, plan_recipe
from areal_hex_plugin.planner.caps import recipe_caps
from areal_hex_plugin.planner.sensitivity import WORKLOAD, Held, Input, Rules, changed, inputs
from areal_hex_plugin.schemas import load_schema
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO
from tests.planner.helpers import recipe_with_pools

H100 = "{tflops_bf16: 989, hbm_gb: 80, hbm_tb_per_s: 3.35, link_gb_per_s: 450}"


def twins(scale: float) -> list[str]:
    """One 8-GPU machine of TWIN-A (H100's figures) and one of TWIN-B (``scale`` times its FLOPS and HBM
    bandwidth), the same price, the generic calibration: at scale 1 the two role assignments tie exactly."""
    b = f"{{tflops_bf16: {989 * scale}, hbm_gb: 80, hbm_tb_per_s: {3.35 * scale}, link_gb_per_s: 450}}"
    return [
        "hex.cluster.pools=[{name: x, gpu_type: TWIN-A, gpus_per_machine: 8, machines: 1, price_per_gpu_hour: 2}, "
        "{name: y, gpu_type: TWIN-B, gpus_per_machine: 8, machines: 1, price_per_gpu_hour: 2}]",
        f"+hex.gpu_catalog={{TWIN-A: {H100}, TWIN-B: {b}}}",
        "hex.objective.budget_per_hour=null",
        "hex.calibration.profile=null",
    ]


SPOT_H20 = [  # the paper recipes' H20 pool preemptible, training allowed there (recover checkpoints)
    "+hex.cluster.pools.1.preemptible=true",
    "+hex.cluster.pools.1.preemptions_per_hour=1",
    "+hex.cluster.pools.1.recovery_s=300",
    "hex.solver.train_on_preemptible=true",
    "recover.mode=auto",
    "recover.freq_steps=10",
]


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        ("recipes/paper/7b.yaml", []),
        # At the price of 16 H800 and 8 H20: the plan generates on the spot H20 and its rollout, slowed by the
        # expected losses, sets the step. (At 16 H800 + 16 H20's price, under the dispatch rule, training on
        # 16 H800 (dp 16) is the longer phase and the rollout's losses do not show; at the recipe's budget the plan
        # rents no spot machine.)
        ("recipes/paper/1.5b.yaml", [*SPOT_H20, "hex.objective.budget_per_hour=99.28"]),
        ("recipes/mixes/h100_rtx4090_qwen3-4b.yaml", []),
    ],
)
def test_a_held_plan_rescores_to_the_planners_prediction(recipe, overrides):
    r = load_recipe(REPO / recipe, overrides)
    plan = plan_recipe(r, PlanRequest(sensitivity=True))
    if overrides:  # the expected losses priced in
        assert plan.predicted.tokens_per_s < plan.predicted.loss_free_tokens_per_s
    cm = CostModel(r.cluster, r.workload, r.calibration)
    held = Held.of_plan(plan).tokens_per_s(cm, Rules.of(r))
    assert held == pytest.approx(plan.predicted.tokens_per_s, rel=1e-6)
    # Every factor of every GPU type of the cluster, and the length distribution's figures, are inputs.
    s = plan.sensitivity
    assert set(s.factors) == set(r.cluster.gpu_types)
    assert all(set(per) == set(FACTORS) for per in s.factors.values())
    assert set(s.workload) == {"mean_tokens", "sigma", "cap_share"}


def test_a_rollout_bound_plan_moves_with_its_rollout_gpus_hbm_and_not_with_training():
    """7B training on 8 H100, generation on 8 L40S (a quarter of H100's HBM bandwidth): rollout sets the step
    with room to spare, so no training factor moves tokens/s, and the L40S decode step (weights and KV read at
    HBM bandwidth, TP all-reduces over PCIe, compute) sets nearly all of it: each of its terms is inversely
    proportional to one factor, so each elasticity is in [0, 1] and together they are at most 1."""
    # L40S's decode factors given as measured (the recipe's own): the roofline, not NVIDIA's kernel data, then
    # times its decode step, so the factors move it.
    measured = "+hex.calibration.gpu_types={L40S: {hbm_fraction: 0.8, infer_mfu: 0.6}}"
    r = recipe_with_pools([("H100", 8, 1), ("L40S", 8, 1)], "7b", measured)
    caps = replace(recipe_caps(r), split_machines=False)
    plan = plan_recipe(r, PlanRequest(sensitivity=True, caps=caps))
    p = plan.predicted
    assert plan.rollout.gpus == {"L40S": 8} and p.rollout_time_s > 1.5 * p.train_time_s, "not rollout-bound"
    f = plan.sensitivity.factors
    assert all(f["H100"][k].tokens_per_s == 0.0 for k in ("train_mfu", "hbm_fraction", "infer_mfu"))
    assert f["L40S"]["train_mfu"].tokens_per_s == 0.0
    rollout = [f["L40S"][k].tokens_per_s for k in ("hbm_fraction", "infer_mfu", "link_efficiency")]
    assert all(0 <= e <= 1 for e in rollout) and sum(rollout) <= 1 + 1e-3
    assert 0.5 < f["L40S"]["hbm_fraction"].tokens_per_s <= 1
    # One machine of a type cannot both train and generate in whole machines: no baseline, no ratio.
    assert (
        plan.baselines["homogeneous-L40S"].tokens_per_s == 0
        and f["L40S"]["hbm_fraction"].vs_best_baseline is None
    )


def test_a_factor_added_to_the_calibration_is_an_input_by_itself():
    @dataclasses.dataclass(frozen=True)
    class Extended(Efficiency):
        kv_rebuild_fraction: float = 0.5

    r = load_recipe(REPO / "recipes/paper/7b.yaml", [])
    calibration = Calibration(overrides=(("H20", Extended()),))
    names = {(i.group, i.name) for i in inputs(["H20"], r.workload, calibration)}
    assert ("H20", "kv_rebuild_fraction") in names and {("H20", k) for k in FACTORS} <= names
    moved = changed(Input("H20", "kv_rebuild_fraction", 0.5), 0.2, r.workload, calibration)
    assert moved[1].for_gpu("H20").kv_rebuild_fraction == pytest.approx(0.6)


@pytest.mark.parametrize("recipe", ["recipes/paper/7b.yaml", "recipes/mixes/h100_rtx4090_qwen3-4b.yaml"])
def test_each_length_change_moves_its_figure_and_holds_the_others(recipe):
    r = load_recipe(REPO / recipe, [])
    cap = r.workload.rl.max_new_tokens
    base = {i.name: i for i in inputs([], r.workload, Calibration())}
    assert base["cap_share"].value > 0

    def figures(workload) -> dict[str, float]:
        lengths = workload.output_lengths.lengths
        body = [n for n in lengths if n < cap]
        logs = [math.log(n) for n in body]
        centre = sum(logs) / len(logs)
        return {
            "body_mean": sum(body) / len(body),
            "sigma": math.sqrt(sum((v - centre) ** 2 for v in logs) / len(logs)),
            "cap_share": 1 - len(body) / len(lengths),
        }

    before = figures(r.workload)
    for name, held in (("mean_tokens", ("cap_share",)), ("sigma", ("cap_share", "body_mean")),
                       ("cap_share", ("body_mean", "sigma"))):  # fmt: skip
        for change in (-0.05, 0.05):
            workload, _, value = changed(base[name], change, r.workload, Calibration())
            assert value == pytest.approx(base[name].value * (1 + change), rel=0.02), (name, change)
            after = figures(workload)
            for other in held:
                assert after[other] == pytest.approx(before[other], rel=2e-3), (name, change, other)


def test_the_flip_check_warns_on_a_tie_and_not_on_a_clear_choice(capsys):
    tie = load_recipe(REPO / "recipes/paper/1.5b.yaml", twins(1.0))
    plan = plan_recipe(tie, PlanRequest(sensitivity=True))
    flips = plan.sensitivity.flips
    assert flips, "the two role assignments tie: some factor of one side must flip the plan"
    chosen = (plan.train.gpus, plan.rollout.gpus)
    for flip in flips:
        assert (flip.train, flip.rollout) != chosen
        # The plan picked instead is faster there, or as fast and cheaper.
        assert (
            flip.tokens_per_s > flip.chosen_tokens_per_s or flip.cost_per_hour < plan.predicted.cost_per_hour
        )
    assert main(["plan", str(REPO / "recipes/paper/1.5b.yaml"), *twins(1.0)]) == 0
    out = capsys.readouterr().out
    assert out.count("warning: the plan hangs on") == len(flips) and "What the ranking hangs on" in out

    # TWIN-B at half of TWIN-A: TWIN-A trains on its whole machine and TWIN-B generates, with a margin no 20%
    # change of one factor closes.
    clear = plan_recipe(
        load_recipe(REPO / "recipes/paper/1.5b.yaml", twins(0.5)), PlanRequest(sensitivity=True)
    )
    assert clear.sensitivity.candidates > 1 and clear.sensitivity.flips == []
    assert not any("hangs on" in w for w in clear.warnings)


def test_the_reproduce_ratios_elasticities_are_valid_and_per_dollar_moves_as_tokens(tmp_path):
    """A ratio per $/h moves as the ratio of tokens/s (the plans' prices do not move)."""
    from areal_hex_plugin.sim.reproduce import H20, H800, paper_request, ratio_elasticities, rented

    r = load_recipe(REPO / "recipes/paper/7b.yaml", [])
    planned = []
    for mix, transport in (({H800: 8, H20: 24}, None), ({H800: 24}, "upstream")):
        on = rented(r, mix, transport)
        planned.append((plan_recipe(on, paper_request(on)), on))
    hex_plan, h800 = planned
    out = ratio_elasticities(r, {"tokens": (hex_plan, h800, False), "dollars": (hex_plan, h800, True)})
    schema = load_schema("reproduce")["properties"]["elasticity"]
    jsonschema.validate({"7B": out}, schema, cls=jsonschema.Draft202012Validator)
    costs = h800[0].predicted.cost_per_hour / hex_plan[0].predicted.cost_per_hour
    assert out["dollars"]["predicted"] == pytest.approx(out["tokens"]["predicted"] * costs)
    assert out["tokens"]["predicted"] == pytest.approx(
        hex_plan[0].predicted.tokens_per_s / h800[0].predicted.tokens_per_s, rel=1e-6
    )
    assert out["dollars"]["factors"] == out["tokens"]["factors"]
    assert set(out["tokens"]["workload"]) == {"mean_tokens", "sigma", "cap_share"}
    assert WORKLOAD not in out["tokens"]["factors"]
