"""``areal-hex plan RECIPE --export slurm|ray|skypilot OUT``: each job run against stand-ins for its scheduler's
commands (``stub_schedulers.py``: sbatch with the environment Slurm gives a plain or heterogeneous job, srun,
scontrol, ray, the job's python) that record what they were asked; Ray's job submission by Ray's own classes;
SkyPilot's job group by SkyPilot 0.14.1's task schema (``data/skypilot_task.schema.json``; skypilot is not installed
here); and the driver command a job holds runs (dry run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_hex_plugin.cli import main
from tests.cli import stub_schedulers
from tests.conftest import REPO

MIX = REPO / "recipes/mixes/a100_l40s_qwen2.5-7b.yaml"
PAPER_7B = REPO / "recipes/paper/7b.yaml"
# Priced out of the plan, the H20 machines leave the 7B paper plan on one pool (H800-PCIe alone).
ONE_POOL = "hex.cluster.pools.1.price_per_gpu_hour=50"


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


def _driver_argv(command: str, plan_path: str, python: str = sys.executable) -> list[str]:
    """The driver's arguments in ``command``, which runs the driver with ``python`` on the saved plan."""
    words = shlex.split(command)
    assert words[:3] == [python, "-m", "areal_hex_plugin.driver"]
    assert f"hex.plan_path={plan_path}" in words and "scheduler.type=hex_ray" in words
    return words[3:]


def _plan_path(job: Path) -> str:
    return str(job.with_name(f"{job.stem}.plan.json"))


@pytest.fixture
def stubs(tmp_path: Path) -> dict:
    """Stand-in scheduler commands on PATH, an install (``venv/bin``) whose python and ray are stand-ins too, and
    the environment to run a job with."""
    bin_dir = stub_schedulers.install(tmp_path / "stubs", ("sbatch", "srun", "scontrol", "sleep"))
    venv = stub_schedulers.install(tmp_path / "venv/bin", ("python", "ray"))
    (tmp_path / "state").mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SKYPILOT_", "RAY_"))},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_LOG": str(tmp_path / "calls.jsonl"),
        "STUB_STATE": str(tmp_path / "state"),
        "AREAL_HEX_TRANSPORT_TOKEN": "t" * 32,
    }
    return {"env": env, "python": str(venv / "python"), "log": tmp_path / "calls.jsonl"}


def _ray_starts(calls: list[dict]) -> list[dict]:
    return [c for c in calls if c["cmd"] == "ray" and c["argv"][0] == "start" and c["ok"]]


def _pool_of(start: dict) -> str:
    resources = next(a.split("=", 1)[1] for a in start["argv"] if a.startswith("--resources="))
    (name,) = json.loads(resources)
    return name.removeprefix("hex_pool:")


def _sbatch(job: Path, stubs: dict, driver_rc: int = 0) -> tuple[int, list[dict]]:
    """Submit ``job`` to the stand-in sbatch; its exit status and what every command was asked."""
    env = {**stubs["env"], "STUB_DRIVER_RC": str(driver_rc)}
    done = subprocess.run(["sbatch", str(job)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == driver_rc, done.stderr
    return done.returncode, stub_schedulers.calls(stubs["log"])


def test_a_one_pool_slurm_job_starts_ray_on_its_nodes_then_the_driver(tmp_path: Path, stubs: dict) -> None:
    """The 7B paper plan on H800 alone uses one pool: a plain job (no hetjob), typed GPUs, the install's python and ray."""
    job, plan = _export(tmp_path, "slurm", "run.sbatch", PAPER_7B, ONE_POOL, "--job-python", stubs["python"])
    _, calls = _sbatch(job, stubs)
    (submitted,) = [c for c in calls if c["cmd"] == "sbatch"]
    (component,) = submitted["components"]
    assert component["nodes"] == "3" and component["gres"] == "gpu:h800-pcie:8"
    starts = _ray_starts(calls)
    assert [s["node"] for s in starts] == ["c0n0", "c0n1", "c0n2"] and "--head" in starts[0]["argv"]
    assert all(_pool_of(s) == "h800" and "--num-gpus=8" in s["argv"] for s in starts)
    assert all("--address=c0n0:6379" in s["argv"] for s in starts[1:])
    (driver,) = [c for c in calls if c["cmd"] == "python"]
    assert driver["ray_address"] == "c0n0:6379"
    _driver_argv(shlex.join([stubs["python"], *driver["argv"]]), _plan_path(job), stubs["python"])
    assert _machines_per_pool(plan) == {"h800": 3}


def test_a_two_pool_slurm_job_types_each_component_and_ends_with_the_driver(
    tmp_path: Path, stubs: dict
) -> None:
    job, plan = _export(
        tmp_path, "slurm", "run.sbatch", MIX, "gconfig.n_samples=8", "--job-python", stubs["python"]
    )
    _, calls = _sbatch(job, stubs, driver_rc=5)  # the job ends with the driver's status
    (submitted,) = [c for c in calls if c["cmd"] == "sbatch"]
    pools = _machines_per_pool(plan)
    gres = {"a100": "gpu:a100-80gb:8", "l40s": "gpu:l40s:8"}
    assert [(c["nodes"], c["gres"]) for c in submitted["components"]] == [
        (str(n), gres[pool]) for pool, n in pools.items()
    ]
    starts = _ray_starts(calls)
    assert "--head" in starts[0]["argv"] and starts[0]["node"] == "c0n0"
    for k, (pool, machines) in enumerate(pools.items()):
        mine = [s for s in starts if _pool_of(s) == pool]
        assert sorted(s["node"] for s in mine) == [f"c{k}n{i}" for i in range(machines)]
    (driver,) = [c for c in calls if c["cmd"] == "python"]
    argv = _driver_argv(shlex.join([stubs["python"], *driver["argv"]]), _plan_path(job), stubs["python"])
    assert "gconfig.n_samples=8" in argv and driver["ray_address"] == "c0n0:6379"


def test_a_slurm_job_runs_the_driver_and_ray_of_this_install_by_default(tmp_path: Path) -> None:
    job, _ = _export(tmp_path, "slurm", "run.sbatch", PAPER_7B)
    text = job.read_text()
    assert re.search(rf"^python={re.escape(shlex.quote(sys.executable))}\s", text, re.M)
    assert re.search(r'^ray="\$\(dirname "\$python"\)/ray"\s', text, re.M)
    _driver_argv(
        text.rstrip().splitlines()[-1].replace('"$python"', shlex.quote(sys.executable)), _plan_path(job)
    )


def test_ray_export_is_a_job_submission_pinned_to_the_head(tmp_path: Path, stubs: dict) -> None:
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME
    from ray.dashboard.modules.job.common import JobSubmitRequest
    from ray.runtime_env import RuntimeEnv

    job, _ = _export(tmp_path, "ray", "job.json", MIX, "--budget", "40", "--job-python", stubs["python"])
    spec = json.loads(job.read_text())
    request = JobSubmitRequest(**spec)
    RuntimeEnv(**request.runtime_env)
    assert all(isinstance(v, str) for v in request.metadata.values())
    # Resources asked of the entrypoint pick its node; only the head has this one (Ray 2.x).
    assert request.entrypoint_resources == {HEAD_NODE_RESOURCE_NAME: 0.001}
    assert request.entrypoint_num_cpus is None and request.entrypoint_num_gpus is None
    done = subprocess.run(["bash", "-c", request.entrypoint], env=stubs["env"], timeout=60)
    assert done.returncode == 0
    (driver,) = stub_schedulers.calls(stubs["log"])
    argv = _driver_argv(shlex.join([stubs["python"], *driver["argv"]]), _plan_path(job), stubs["python"])
    assert "hex.objective.budget_per_hour=40" in argv  # the run keeps the budget the plan was made for


def _skypilot_schema() -> dict:
    return json.loads((Path(__file__).parent / "data/skypilot_task.schema.json").read_text())


def _job_group(job: Path) -> tuple[dict, list[dict]]:
    """The job group's header and tasks, each checked against SkyPilot 0.14.1's schema."""
    import jsonschema

    header, *tasks = yaml.safe_load_all(job.read_text())
    schema = _skypilot_schema()
    jsonschema.validate(header, {**schema, "$ref": "#/$defs/job_group_header"})
    for task in tasks:
        jsonschema.validate(task, {**schema, "$ref": "#/$defs/task"})
    names = [t["name"] for t in tasks]
    assert len(set(names)) == len(names) and set(header["primary_tasks"]) <= set(names)
    return header, tasks


def test_skypilot_export_is_a_job_group_of_one_task_per_gpu_type_of_the_plan(tmp_path: Path) -> None:
    """The mix's plan uses both its GPU types: one task each, in parallel, named as SkyPilot's catalog names
    them; the recipe and plan travel as file mounts; the set-up installs the GPU profile."""
    job, plan = _export(tmp_path, "skypilot", "task.yaml", MIX)
    header, tasks = _job_group(job)
    assert header["execution"] == "parallel" and header["primary_tasks"] == [tasks[0]["name"]]
    pools = _machines_per_pool(plan)
    accelerators = {"a100": "A100-80GB:8", "l40s": "L40S:8"}
    assert [(t["name"], t["num_nodes"], t["resources"]["accelerators"]) for t in tasks] == [
        (pool, n, accelerators[pool]) for pool, n in pools.items()
    ]
    for task in tasks:
        assert sorted(task["file_mounts"].values()) == sorted([str(MIX), _plan_path(job)])
        assert (
            Path(task["workdir"], "scripts/setup.sh").is_file()
            and task["setup"] == "bash scripts/setup.sh --gpu"
        )
        assert task["secrets"] == {"AREAL_HEX_TRANSPORT_TOKEN": None}  # never written: given at launch


def _run_job_group(job: Path, stubs: dict, tmp_path: Path) -> list[dict]:
    """Every node of every task runs its task's ``run`` at once, as SkyPilot would (in the workdir, with the file
    mounts in place); all must end by themselves."""
    _, tasks = _job_group(job)
    home, workdir = tmp_path / "home", tmp_path / "home/sky_workdir"
    stub_schedulers.install(workdir / ".venv/bin", ("python", "ray"))
    for task in tasks:
        for remote, local in task["file_mounts"].items():
            target = home / remote.removeprefix("~/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(Path(local).read_text())
    nodes = []
    for task in tasks:
        for rank in range(task["num_nodes"]):
            env = {
                **stubs["env"],
                "HOME": str(home),
                "SKYPILOT_NODE_RANK": str(rank),
                "SKYPILOT_NUM_NODES": str(task["num_nodes"]),
                "SKYPILOT_JOBGROUP_NAME": "group",
                "STUB_NODE": f"{task['name']}-{rank}.group",
                **task["envs"],
            }
            nodes.append(subprocess.Popen(["bash", "-c", task["run"]], cwd=workdir, env=env))
    assert [node.wait(timeout=120) for node in nodes] == [0] * len(nodes)
    return stub_schedulers.calls(stubs["log"])


def test_a_skypilot_job_group_runs_the_driver_on_the_head_and_every_node_ends(
    tmp_path: Path, stubs: dict
) -> None:
    job, plan = _export(tmp_path, "skypilot", "task.yaml", MIX, "gconfig.n_samples=8")
    calls = _run_job_group(job, stubs, tmp_path)
    starts = _ray_starts(calls)
    head = "a100-0.group"
    # Every node starts at once, so the calls' order says nothing: one head start, on the head node.
    (head_start,) = [s for s in starts if "--head" in s["argv"]]
    assert head_start["node"] == head
    assert all(f"--address={head}:6379" in s["argv"] for s in starts if s is not head_start)
    pools = _machines_per_pool(plan)
    assert {p: sum(_pool_of(s) == p for s in starts) for p in pools} == pools
    (driver,) = [c for c in calls if c["cmd"] == "python"]
    assert driver["node"] == head and driver["ray_address"] == f"{head}:6379"
    assert Path(driver["cwd"]) == tmp_path / "home/areal-hex"  # where the mounts put the recipe and plan
    words = driver["argv"]
    assert (
        words[:4] == ["-m", "areal_hex_plugin.driver", "--config", MIX.name]
        and "gconfig.n_samples=8" in words
    )
    assert f"hex.plan_path={Path(_plan_path(job)).name}" in words and "scheduler.type=hex_ray" in words
    # The head stops its Ray after the driver; every other node's run ends once that cluster is gone.
    stops = [c for c in calls if c["cmd"] == "ray" and c["argv"][0] == "stop"]
    assert stops[0]["node"] == head and calls.index(stops[0]) > calls.index(driver)
    assert sorted(c["node"] for c in stops) == sorted(s["node"] for s in starts)


def test_a_skypilot_export_maps_gpu_types_it_cannot_name(tmp_path: Path, capsys) -> None:
    """SkyPilot's catalog has no H800-PCIe: refused with the flag that names it; with the flag, that name."""
    job = tmp_path / "task.yaml"
    assert main(["plan", str(PAPER_7B), ONE_POOL, "--export", "skypilot", str(job)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--accelerator-map H800-PCIe=NAME" in err and "H800-PCIe" in err
    assert not list(tmp_path.iterdir())  # nothing written
    _, tasks = _job_group(
        _export(tmp_path, "skypilot", "task.yaml", PAPER_7B, ONE_POOL, "--accelerator-map", "H800-PCIe=H800")[
            0
        ]
    )
    assert [t["resources"]["accelerators"] for t in tasks] == ["H800:8"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--export", "kubernetes", "JOB"], "--export: unknown target 'kubernetes'"),
        (
            ["--export", "slurm", "JOB", "--accelerator-map", "H800"],
            "--accelerator-map: 'H800' is not TYPE=NAME",
        ),
        (
            ["--export", "slurm", "JOB", "--accelerator-map", "B200=b200"],
            "--accelerator-map: 'B200' is not a GPU",
        ),
        (
            ["--export", "skypilot", "JOB", "--job-python", "/opt/py"],
            "--job-python: the SkyPilot task installs",
        ),
        (["--accelerator-map", "A100=a100"], "--accelerator-map: goes with --export"),
    ],
    ids=["unknown-target", "map-not-a-pair", "map-unknown-type", "skypilot-python", "map-without-export"],
)
def test_an_export_that_cannot_be_made_is_refused_before_solving(
    argv, message, tmp_path: Path, capsys
) -> None:
    argv = [a.replace("JOB", str(tmp_path / "job")) for a in argv]
    assert main(["plan", str(MIX), *argv]) == 2
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
    argv = _driver_argv(json.loads(job.read_text())["entrypoint"], _plan_path(job))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    capsys.readouterr()
    assert driver_main([*argv, "hex.dry_run=true", f"cluster.fileroot={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"plan {job.with_name('job.plan.json')}" in out and "note live inventory: not checked" in out
