"""``areal-hex check RECIPE``, the pre-flight the driver and its dry run share: each case the review found gets
exit 2 and one message naming the key and the fix, no traceback."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.cli import main  # noqa: E402
from areal_hex_plugin.driver import main as driver_main  # noqa: E402
from tests.conftest import REPO  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("transport_token", "no_ray_cluster")]
RECIPE = REPO / "recipes/paper/1.5b.yaml"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's plan, saved once: the checks below then load it instead of solving."""
    from areal_hex_plugin.planner import plan_recipe
    from areal_hex_plugin.specs.recipe import load_recipe

    return plan_recipe(load_recipe(RECIPE)).save(tmp_path_factory.mktemp("plan") / "plan.json")


def _refused(capsys, *argv: str) -> str:
    """Run ``areal-hex *argv``: exit 2 and one error message, which is returned."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    return err.split("error:", 1)[1]


def _edited(tmp_path: Path, old: str, new: str) -> Path:
    text = RECIPE.read_text()
    assert old in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace(old, new))
    return path


def test_a_ready_recipe_passes_every_check_but_the_live_one_offline(plan_file: Path, capsys) -> None:
    assert main(["check", str(RECIPE), f"hex.plan_path={plan_file}", "--offline"]) == 0
    out = capsys.readouterr().out
    for line in (
        "ok   upstream config:",
        "ok   hex.workflow:",
        "ok   transport: relay (token set)",
        "ok   plan:",
    ):
        assert line in out
    assert "note live inventory: not checked (--offline)" in out and ": ready to run: python -m" in out


def test_an_upstream_typo_in_the_recipe_names_the_key_meant(plan_file: Path, tmp_path: Path, capsys) -> None:
    recipe = _edited(tmp_path, "  mem_fraction_static:", "  mem_fraction_statc:")
    message = _refused(capsys, "check", str(recipe), f"hex.plan_path={plan_file}", "--offline")
    assert message.startswith(" sglang.mem_fraction_statc: unknown key")
    assert "did you mean sglang.mem_fraction_static?" in message


def test_an_upstream_typo_in_an_override_names_the_key_meant(capsys) -> None:
    message = _refused(capsys, "check", str(RECIPE), "sglang.mem_fraction_statc=0.5", "--offline")
    assert "write sglang.mem_fraction_static=0.5" in message


def test_a_budget_added_at_the_top_points_at_the_objective(capsys) -> None:
    message = _refused(capsys, "check", str(RECIPE), "+budget=60", "--offline")
    assert "budget: is not a key of the config" in message
    assert "write hex.objective.budget_per_hour=60" in message


def test_a_value_upstream_cannot_take_names_its_key(plan_file: Path, capsys) -> None:
    message = _refused(capsys, "check", str(RECIPE), f"hex.plan_path={plan_file}", "sglang.mem_fraction_static=lots", "--offline")  # fmt: skip
    assert message.startswith(" sglang.mem_fraction_static:")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("hex.workflow=no_such_package.Workflow", "hex.workflow: 'no_such_package.Workflow' names no class"),
        (
            "hex.workflow=areal.workflow.rlvr.RLVRWorkflw",
            "write hex.workflow=areal.workflow.rlvr.RLVRWorkflow",
        ),
        (
            "hex.reward_fn=areal.reward.gsm8k.gsm8k_reward",
            "areal.reward.gsm8k has no function 'gsm8k_reward'",
        ),
    ],
    ids=["no-module", "misspelt-class", "misspelt-reward"],
)
def test_a_workflow_or_reward_that_does_not_import_is_refused(
    plan_file: Path, override, expected, capsys
) -> None:
    message = _refused(capsys, "check", str(RECIPE), f"hex.plan_path={plan_file}", override, "--offline")
    assert expected in message


def test_the_relay_without_its_token_is_refused(plan_file: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("AREAL_HEX_TRANSPORT_TOKEN")
    message = _refused(capsys, "check", str(RECIPE), f"hex.plan_path={plan_file}", "--offline")
    assert message.startswith(" AREAL_HEX_TRANSPORT_TOKEN: missing")


def test_a_saved_plan_over_the_budget_is_refused_with_the_fix(plan_file: Path, capsys) -> None:
    cost = json.loads(plan_file.read_text())["predicted"]["cost_per_hour"]
    budget = f"hex.objective.budget_per_hour={cost - 10:g}"
    argv = ["check", str(RECIPE), f"hex.plan_path={plan_file}", budget, "--offline"]
    message = _refused(capsys, *argv)
    assert message.startswith(" hex.plan_path: the plan at") and "over its budget" in message
    assert f"areal-hex plan {RECIPE} --json {plan_file}" in message


def test_no_reachable_cluster_is_refused_naming_the_scheduler(plan_file: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi here
    message = _refused(capsys, "check", str(RECIPE), f"hex.plan_path={plan_file}", "scheduler.type=hex_local")
    assert message.startswith(" scheduler.type=hex_local: cannot read the live local inventory")
    command = message.split("or check everything else with ", 1)[1].strip()
    assert command == f"areal-hex check {RECIPE} --offline"
    assert main([*shlex.split(command)[1:], f"hex.plan_path={plan_file}"]) == 0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["hex.workflow=no_such_package.Workflow"], "names no class"),
        (["sglang.mem_fraction_statc=0.5"], "did you mean sglang.mem_fraction_static?"),
        (["hex.objective.budget_per_hour=50"], "over its budget"),  # the plan costs $99.28/h
    ],
    ids=["workflow", "upstream-typo", "plan-over-budget"],
)
def test_the_dry_run_runs_the_same_checks(plan_file: Path, extra, expected, tmp_path: Path, capsys) -> None:
    argv = ["--config", str(RECIPE), "hex.dry_run=true", f"hex.plan_path={plan_file}", *extra]
    assert driver_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and expected in err


def test_the_dry_run_without_the_key_in_the_recipe_and_its_checks(
    plan_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("HEX_LOCAL_GPUS", raising=False)
    recipe = _edited(tmp_path, "  dry_run: false\n", "")
    argv = [
        "--config",
        str(recipe),
        "hex.dry_run=true",
        f"hex.plan_path={plan_file}",
        "scheduler.type=hex_local",
    ]
    assert driver_main(argv) == 0
    out = capsys.readouterr().out
    assert "nothing was started" in out and "ok   transport: relay (token set)" in out
    # No GPUs here: the dry run says the live inventory went unchecked, and why.
    assert "note live inventory: not checked (cannot read the live local inventory" in out


def test_simulate_refuses_a_saved_plan_over_the_budget(plan_file: Path, capsys) -> None:
    cost = json.loads(plan_file.read_text())["predicted"]["cost_per_hour"]
    message = _refused(capsys, "simulate", str(RECIPE), "--plan", str(plan_file), f"hex.objective.budget_per_hour={cost - 10:g}")  # fmt: skip
    assert message.startswith(" --plan: the plan at") and "over its budget" in message


def _recover_dump(tmp_path: Path, checkpoint_after_info: bool, global_step: int = 2) -> list[str]:
    """Upstream's recover layout for the recipe's experiment under ``tmp_path`` (its own path functions), the
    checkpoint written before its step info as upstream does, or after it (a dump the run stopped inside); the
    last step trained ``global_step`` of 8 per epoch."""
    import os

    from areal.api.io_struct import StepInfo
    from areal.utils.recover import RecoverHandler, RecoverInfo
    from areal.utils.saver import Saver

    names = (
        "experiment_name=hex-recover",
        "trial_name=t0",
        f"cluster.fileroot={tmp_path}",
        "recover.mode=auto",
    )
    checkpoint = Path(Saver.get_recover_checkpoint_path("hex-recover", "t0", str(tmp_path)))
    info = Path(RecoverHandler.recover_info_path("hex-recover", "t0", str(tmp_path))) / "step_info.json"
    (checkpoint / "__0_0.distcp").write_bytes(b"w")
    step = StepInfo(epoch=0, epoch_step=global_step, global_step=global_step, steps_per_epoch=8)
    RecoverInfo(step, {}, {}, {}, {}, {}).dump(str(info.parent))
    os.utime(checkpoint / "__0_0.distcp", (100, 100))
    os.utime(info, (200, 200))
    if checkpoint_after_info:
        os.utime(checkpoint / "__0_0.distcp", (300, 300))
    return list(names)


def test_a_consistent_recover_checkpoint_is_what_the_run_resumes_from(
    plan_file: Path, tmp_path: Path, capsys
) -> None:
    names = _recover_dump(tmp_path, checkpoint_after_info=False)
    assert main(["check", str(RECIPE), f"hex.plan_path={plan_file}", *names, "--offline"]) == 0
    out = capsys.readouterr().out
    assert "ok   recover: resumes from" in out and "at step 4 of 8" in out


def test_a_run_that_trained_every_step_ends_at_once_starting_nothing(
    plan_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The same command again after the run's last step: upstream would start every worker and server only to
    train nothing. The driver says so and ends (no live inventory read: none is here); check says it too, and a
    higher total_train_steps trains on."""
    monkeypatch.delenv("HEX_LOCAL_GPUS", raising=False)
    names = [*_recover_dump(tmp_path, checkpoint_after_info=False, global_step=7), "total_train_epochs=1"]
    argv = [f"hex.plan_path={plan_file}", "scheduler.type=hex_local", *names]
    assert driver_main(["--config", str(RECIPE), *argv]) == 0
    err = capsys.readouterr().err
    assert "already trained its 8 steps" in err and "nothing was started" in err, err
    assert "raise total_train_steps" in err and "Traceback" not in err
    assert main(["check", str(RECIPE), *argv, "--offline"]) == 0
    assert "ok   recover: the run already trained its 8 steps" in capsys.readouterr().out
    # Two more epochs asked for: the run resumes (here it then needs the live inventory, which is not here).
    assert driver_main(["--config", str(RECIPE), *argv, "total_train_epochs=3"]) == 2
    assert "already trained" not in capsys.readouterr().err


def test_a_recover_checkpoint_written_after_its_step_info_is_refused(
    plan_file: Path, tmp_path: Path, capsys
) -> None:
    names = _recover_dump(tmp_path, checkpoint_after_info=True)
    message = _refused(capsys, "check", str(RECIPE), f"hex.plan_path={plan_file}", *names, "--offline")
    assert message.startswith(" recover: the recover checkpoint") and "was being written" in message
    assert "fix: start this trial afresh" in message
    # Recovery off: nothing is resumed, nothing to refuse.
    assert (
        main(["check", str(RECIPE), f"hex.plan_path={plan_file}", *names, "recover.mode=off", "--offline"])
        == 0
    )
    assert "recover:" not in capsys.readouterr().out
