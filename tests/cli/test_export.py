"""``areal-hex plan RECIPE --export slurm|ray|skypilot OUT``: each job checked by the scheduler's own parser where
one is installed here (bash for sbatch, Ray's job submission and runtime_env classes), SkyPilot's task by its
documented fields as a JSON schema (skypilot is not installed); and the driver command it holds runs (dry run)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from areal_hex_plugin.cli import main
from tests.conftest import REPO

MIX = REPO / "recipes/mixes/a100_l40s_qwen2.5-7b.yaml"


def _export(tmp_path: Path, kind: str, out: str, recipe: Path = MIX, *extra: str) -> tuple[Path, dict]:
    """Export into a folder that does not exist yet; the job and the plan beside it."""
    job = tmp_path / "new" / "folder" / out
    shown = tmp_path / "shown.json"
    assert main(["plan", str(recipe), "--export", kind, str(job), *extra, "--json", str(shown)]) == 0
    plan = json.loads(job.with_name(f"{job.stem}.plan.json").read_text())
    assert plan == json.loads(shown.read_text())  # the plan beside the job is the plan shown
    return job, plan


def _machines_per_pool(plan: dict) -> dict[str, int]:
    used: dict[str, int] = {}
    for m in plan["machines"]:
        if any(g["role"] != "idle" for g in m["gpus"]):
            used[m["pool"]] = used.get(m["pool"], 0) + 1
    return used


def _driver_argv(command: str, job: Path) -> list[str]:
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "areal_hex_plugin.driver"]
    assert (
        f"hex.plan_path={job.with_name(f'{job.stem}.plan.json')}" in words
        and "scheduler.type=hex_ray" in words
    )
    return words[3:]


def test_slurm_export_asks_for_the_plans_machines(tmp_path: Path) -> None:
    job, plan = _export(tmp_path, "slurm", "run.sbatch", MIX, "gconfig.n_samples=8")
    text = job.read_text()
    assert subprocess.run(["bash", "-n", str(job)], capture_output=True).returncode == 0
    components = text.split("\n\n")[0].split("#SBATCH hetjob")
    pools = _machines_per_pool(plan)
    assert len(components) == len(pools)
    gpus = {"a100": 8, "l40s": 8}
    for k, (component, (pool, machines)) in enumerate(zip(components, pools.items(), strict=True)):
        sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", component, re.M))
        assert sbatch["nodes"] == str(machines) and sbatch["gres"] == f"gpu:{gpus[pool]}"
        assert f"# pool {pool}: {machines} x" in component
        # Each component's nodes join Ray with their pool's resource, which pins the pool's workers there.
        assert re.search(rf"^srun --het-group={k} .*ray start .*'{{\"hex_pool:{pool}\": 1}}'", text, re.M)
    command = text.rstrip().splitlines()[-1]
    assert "gconfig.n_samples=8" in _driver_argv(command, job)


def test_ray_export_is_a_job_submission_rays_classes_accept(tmp_path: Path) -> None:
    from ray.dashboard.modules.job.common import JobSubmitRequest
    from ray.runtime_env import RuntimeEnv

    job, _ = _export(tmp_path, "ray", "job.json", MIX, "--budget", "40")
    spec = json.loads(job.read_text())
    request = JobSubmitRequest(**spec)
    RuntimeEnv(**request.runtime_env)
    assert all(isinstance(v, str) for v in request.metadata.values())
    argv = _driver_argv(request.entrypoint, job)
    assert "hex.objective.budget_per_hour=40" in argv  # the run keeps the budget the plan was made for


@pytest.fixture
def one_type_recipe(tmp_path: Path) -> Path:
    text = (REPO / "recipes/paper/1.5b.yaml").read_text()
    head, rest = text.split("      - name: h800\n", 1)
    recipe = tmp_path / "h20.yaml"
    recipe.write_text(head + "      - name: h20\n" + rest.split("      - name: h20\n", 1)[1])
    return recipe


def test_skypilot_export_matches_the_task_schema(tmp_path: Path, one_type_recipe: Path) -> None:
    import jsonschema

    job, plan = _export(tmp_path, "skypilot", "task.yaml", one_type_recipe, "~hex.objective.budget_per_hour")
    task = yaml.safe_load(job.read_text())
    schema = json.loads((Path(__file__).parent / "data/skypilot_task.schema.json").read_text())
    jsonschema.validate(task, schema)
    assert task["num_nodes"] == sum(_machines_per_pool(plan).values())
    assert task["resources"]["accelerators"] == "H20:8"
    assert task["secrets"] == {"AREAL_HEX_TRANSPORT_TOKEN": None}  # never written: given at launch
    assert subprocess.run(["bash", "-n"], input=task["run"], text=True).returncode == 0
    command = next(line for line in task["run"].splitlines() if "areal_hex_plugin.driver" in line)
    _driver_argv(command.split('" ', 1)[1], job)


@pytest.mark.parametrize(
    ("kind", "message"),
    [("kubernetes", "--export: unknown target 'kubernetes'"), ("skypilot", "SkyPilot launches one GPU type")],
    ids=["unknown-target", "skypilot-mixed"],
)
def test_an_export_that_cannot_be_made_is_refused_before_solving(
    kind, message, tmp_path: Path, capsys
) -> None:
    assert main(["plan", str(MIX), "--export", kind, str(tmp_path / "job")]) == 2
    out, err = capsys.readouterr()
    assert err.count("error:") == 1 and message in err and out == ""  # refused before the plan was shown
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.integration
def test_the_exported_driver_command_runs(
    tmp_path: Path, transport_token, no_ray_cluster, monkeypatch, capsys
) -> None:
    """The command the Ray job holds, run as a dry run here: the plan beside it loads and passes the pre-flight
    (no Ray cluster here: the dry run says so)."""
    pytest.importorskip("areal")
    from areal_hex_plugin.driver import main as driver_main

    job, _ = _export(tmp_path, "ray", "job.json")
    argv = _driver_argv(json.loads(job.read_text())["entrypoint"], job)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    capsys.readouterr()
    assert driver_main([*argv, "hex.dry_run=true", f"cluster.fileroot={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"plan {job.with_name('job.plan.json')}" in out and "note live inventory: not checked" in out
