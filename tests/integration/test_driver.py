"""The driver: dry-run on every shipped recipe, and bad input stopping before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.driver import main  # noqa: E402
from tests.conftest import RECIPES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("transport_token", "no_ray_cluster")]


def _argv(recipe: Path, tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "nr").mkdir(exist_ok=True)
    return [
        "--config",
        str(recipe),
        f"cluster.fileroot={tmp_path}",
        f"cluster.name_resolve.nfs_record_root={tmp_path / 'nr'}",
        *extra,
    ]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_dry_run_prints_rewrite_and_placement(recipe: Path, tmp_path: Path, capsys) -> None:
    assert main(_argv(recipe, tmp_path, "hex.dry_run=true")) == 0
    out = capsys.readouterr().out
    assert "nothing was started" in out
    backends = [line.split(": ", 1)[1] for line in out.splitlines() if line.strip().startswith("backend:")]
    assert backends[0].split(":")[0] in ("fsdp", "megatron") and backends[1].startswith("sglang:d")
    assert "max_head_offpolicyness:" in out and "max_concurrent_rollouts:" in out
    roles = {line.split()[0] for line in out.split("# Placement")[1].splitlines()[3:] if line.strip()}
    assert {"actor", "rollout"} <= roles


def test_dry_run_shows_the_routing_policy_the_controller_will_use(tmp_path: Path, capsys) -> None:
    recipe = REPO / "recipes/paper/7b.yaml"
    assert main(_argv(recipe, tmp_path, "hex.dry_run=true", "hex.routing=least_outstanding")) == 0
    assert "by hex.routing=least_outstanding" in capsys.readouterr().out


def _save_plan(recipe: Path, path: Path) -> Path:
    from areal_hex_plugin.planner import plan_recipe
    from areal_hex_plugin.specs.recipe import load_recipe

    return plan_recipe(load_recipe(recipe)).save(path)


def test_dry_run_follows_a_saved_plan(tmp_path: Path, capsys) -> None:
    recipe = REPO / "recipes/paper/1.5b.yaml"
    plan_file = _save_plan(recipe, tmp_path / "plan.json")
    assert main(_argv(recipe, tmp_path, "hex.dry_run=true", f"hex.plan_path={plan_file}")) == 0
    assert f"plan {plan_file}" in capsys.readouterr().out


def test_stale_plan_for_another_model_exits_2(tmp_path: Path, capsys) -> None:
    plan_file = _save_plan(REPO / "recipes/paper/7b.yaml", tmp_path / "plan7b.json")
    code = main(_argv(REPO / "recipes/paper/1.5b.yaml", tmp_path, f"hex.plan_path={plan_file}"))
    assert code == 2
    assert "made for model DeepSeek-R1-Distill-Qwen-7B" in capsys.readouterr().err


def test_unknown_scheduler_type_exits_2_without_traceback(tmp_path: Path) -> None:
    argv = _argv(REPO / "recipes/paper/1.5b.yaml", tmp_path, "scheduler.type=kubernetes")
    proc = subprocess.run(
        [sys.executable, "-m", "areal_hex_plugin.driver", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unknown scheduler type 'kubernetes'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["hex.plan_path=/nonexistent/plan.json"], "cannot read /nonexistent/plan.json"),
        # No GPUs here: hex_local finds no live inventory and stops before starting workers.
        (["scheduler.type=hex_local"], "nvidia-smi is not on PATH"),
        (["actor.weight_update_mode=disk"], "actor.weight_update_mode: is 'disk'"),
        (
            ["hex.workflow=no_such_package.Workflow"],
            "hex.workflow: 'no_such_package.Workflow' names no class",
        ),
        (
            ["hex.workflow=areal.workflow.rlvr.RLVRWorkflow", "+hex.reward_fn=no_such_package.reward"],
            "hex.reward_fn: 'no_such_package.reward' names no function",
        ),
    ],
)
def test_bad_input_exits_2_before_any_worker(extra, message, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", "0123456789abcdef")
    assert main(_argv(REPO / "recipes/paper/1.5b.yaml", tmp_path, *extra)) == 2
    assert message in capsys.readouterr().err
    # Upstream's loader saved config.yaml, but no worker ever wrote a log: nothing was started.
    assert not list(tmp_path.rglob("*.log"))


def test_relay_without_a_token_exits_2_before_any_worker(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("AREAL_HEX_TRANSPORT_TOKEN", raising=False)
    assert main(_argv(REPO / "recipes/paper/1.5b.yaml", tmp_path)) == 2
    assert "AREAL_HEX_TRANSPORT_TOKEN: missing" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.log"))


def _retile(group: dict, tp: int) -> None:
    """The replica group on the same GPUs as tp-way servers without pipeline stages."""
    group.update(count=group["count"] * group["tp"] * group["pp"] // tp, tp=tp, pp=1)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda p: p["machines"][0]["gpus"][0].update(gpu=999), "plan.machines[0].gpus[0].gpu"),
        (lambda p: p["train"]["stages"][0].update(layers=1000), "plan.train.stages"),
        (lambda p: p["machines"][0].update(host="ghost-host"), "plan.machines[0].host"),
        (lambda p: p["rollout"]["replicas"][0].update(pool="ghost-pool"), "plan.rollout.replicas[0].pool"),
        (
            lambda p: p["staleness"].update(max_concurrent_rollouts=0, max_head_offpolicyness=-1),
            "plan.staleness.max_head_offpolicyness",
        ),
        # Hand edits the cost model refuses, as the planner would never build them: 1.5B has 12 heads.
        (lambda p: _retile(p["rollout"]["replicas"][0], tp=8), "plan.rollout.replicas[0]"),
        (lambda p: p["train"]["stages"][0].update(tp=8, dp=1), "plan.train"),
    ],
    ids=["gpu-999", "layers-1000", "ghost-host", "ghost-pool", "staleness", "rollout-tp8", "train-tp8"],
)
def test_dry_run_refuses_a_plan_that_does_not_fit_the_recipe(edit, field, tmp_path: Path, capsys) -> None:
    """Issue 16: the dry run printed these plans into the upstream config and exited 0."""
    import json

    recipe = REPO / "recipes/paper/1.5b.yaml"
    plan = json.loads(_save_plan(recipe, tmp_path / "plan.json").read_text())
    edit(plan)
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    assert main(_argv(recipe, tmp_path, "hex.dry_run=true", f"hex.plan_path={tmp_path / 'bad.json'}")) == 2
    captured = capsys.readouterr()
    began, err = captured.err.split("\n", 1)  # the line the run begins with, then one message
    assert began.startswith("areal-hex: ") and err.startswith(f"error: {field}") and "fix:" in err, (
        captured.err
    )
    assert "# Placement" not in captured.out


def test_a_run_says_it_began_within_two_seconds_then_what_it_decided(tmp_path: Path, transport_token) -> None:
    """The first line comes before upstream is imported; the plan table, the pre-flight, the placement and the
    changes to the config follow, as the dry run shows them and a real run prints them before starting workers."""
    import os
    import time

    recipe = REPO / "recipes/ci/tiny.yaml"
    env = {
        **os.environ,
        "AREAL_HEX_TRANSPORT_TOKEN": transport_token,
        "HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2",
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_hex_plugin.driver", *_argv(recipe, tmp_path, "hex.dry_run=true")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stderr.readline()
    began_s = time.monotonic() - start
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert first.startswith(f"areal-hex: {recipe}: planning and checking"), first
    assert began_s < 2.0, began_s
    sections = [
        "# Plan",
        "AReaL-Hex plan for",
        "# Pre-flight",
        "# Upstream config",
        "# Placement",
        "Predicted:",
    ]
    assert [out.index(s) for s in sections] == sorted(out.index(s) for s in sections)
    assert "change: actor.backend: fsdp:d2 -> fsdp:d2t1: the plan trains on 2 GPUs" in out
    assert "change: rollout.max_concurrent_rollouts: 16 -> 3" in out


def test_a_recover_config_that_cannot_resume_is_refused_before_anything_starts(
    tmp_path: Path, capsys
) -> None:
    recipe = REPO / "recipes/ci/tiny.yaml"  # recover.mode on, no optimizer state saved
    assert main(_argv(recipe, tmp_path, "hex.dry_run=true", "recover.no_load_optim=false")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("areal-hex: ") and len(err) == 3, (
        err
    )  # the run began; then one message: error, fix
    assert err[1].startswith("error: recover.no_load_optim: is false while recover.no_save_optim is true"), (
        err
    )
    assert "set recover.no_load_optim=true" in err[2]
    assert (
        main(_argv(recipe, tmp_path, "hex.dry_run=true", "recover.mode=off", "recover.no_load_optim=false"))
        == 0
    )
