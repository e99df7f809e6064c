"""``areal-hex plan RECIPE --export slurm|ray|skypilot OUT``: a job that runs the driver with the plan.

The plan is written beside ``OUT`` (``<OUT stem>.plan.json``) and handed to the driver as ``hex.plan_path``, with the
command's own overrides, so the run is the plan shown. Every target runs the driver on a Ray cluster
(``scheduler.type=hex_ray``), which pins each role to its pool's nodes:

- ``slurm``: an sbatch script, one heterogeneous-job component per pool (its machines, GPUs per machine and, where
  the recipe names the hosts, ``--nodelist``), which starts Ray on the allocation and then the driver.
- ``ray``: a Ray Jobs submission (entrypoint + runtime_env, as ``ray job submit`` and ``JobSubmissionClient``
  take it) for a Ray cluster already up with the plan's machines.
- ``skypilot``: a SkyPilot task (one GPU type per task: SkyPilot cannot mix types in one cluster) that starts Ray
  over its nodes and the driver on the first.

Paths are absolute: the recipe, the plan and the repository must be where the job runs (a shared file system,
as AReaL's NFS name_resolve needs anyway). The relay's token is never written: every machine must export it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from areal_hex_plugin.errors import HexError

KINDS = ("slurm", "ray", "skypilot")
TOKEN_ENV = "AREAL_HEX_TRANSPORT_TOKEN"
POOL_RESOURCE = "hex_pool:"  # the Ray resource HexRayScheduler pins a pool's bundles with (schedulers/ray.py)
RAY_PORT = 6379


@dataclass(frozen=True)
class PoolNodes:
    """The machines a plan uses in one pool."""

    pool: str
    gpu_type: str
    gpus_per_machine: int
    hosts: tuple[str, ...]  # the recipe's host names, or empty when it numbers its machines
    count: int


def plan_pools(plan, cluster) -> list[PoolNodes]:
    """Per pool, in the cluster's order, the machines with a GPU at work in ``plan``."""
    used: dict[str, list[str]] = {}
    for machine in plan.machines:
        if any(g.role != "idle" for g in machine.gpus):
            used.setdefault(machine.pool, []).append(machine.host)
    return [
        PoolNodes(
            p.name, p.gpu_type, p.gpus_per_machine, tuple(used[p.name]) if p.hosts else (), len(used[p.name])
        )
        for p in cluster.pools
        if p.name in used
    ]


def paths(out: str) -> tuple[Path, Path]:
    """Where the job and the plan beside it go (absolute)."""
    job = Path(out).expanduser().absolute()
    return job, job.with_name(f"{job.stem}.plan.json")


def driver_command(recipe: str, overrides: list[str], plan_path: Path) -> str:
    """The driver on the recipe with the command's overrides and the saved plan, on the Ray scheduler."""
    words = ["python", "-m", "areal_hex_plugin.driver", "--config", str(Path(recipe).absolute()), *overrides]
    return shlex.join([*words, f"hex.plan_path={plan_path}", "scheduler.type=hex_ray"])


def _ray_start(pool: PoolNodes, head: bool) -> str:
    resources = json.dumps({f"{POOL_RESOURCE}{pool.pool}": 1})
    where = "--head --port=$port" if head else '--address="$head:$port"'
    return (
        f"ray start {where} --num-gpus={pool.gpus_per_machine} --resources={shlex.quote(resources)} --block"
    )


def sbatch_script(plan, recipe, job_name: str, command: str, log: Path) -> str:
    """The sbatch script: a heterogeneous job of the plan's pools, Ray over it, then the driver."""
    pools = plan_pools(plan, recipe.cluster)
    lines = [
        "#!/bin/bash",
        f"# AReaL-Hex: {plan.model} with the plan beside this script (areal-hex plan --export slurm).",
        "# One heterogeneous-job component per pool of the plan; Ray over its nodes, the driver on the first.",
        "# Pick each pool's nodes as your site names them where no --nodelist is given (--partition/--constraint).",
    ]
    for k, pool in enumerate(pools):
        if k:
            lines.append("#SBATCH hetjob")
        if k == 0:
            lines += [f"#SBATCH --job-name={job_name}", f"#SBATCH --output={log}"]
        lines += [
            f"#SBATCH --nodes={pool.count}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gres=gpu:{pool.gpus_per_machine}",
            "#SBATCH --exclusive",
            f"# pool {pool.pool}: {pool.count} x {pool.gpus_per_machine} {pool.gpu_type}",
        ]
        if pool.hosts:
            lines.append(f"#SBATCH --nodelist={','.join(pool.hosts)}")
    lines += [
        "",
        "set -euo pipefail",
        f': "${{{TOKEN_ENV}:?export {TOKEN_ENV} (e.g. openssl rand -hex 16) before sbatch}}"',
        "export PYTHONUNBUFFERED=1",
        f"port={RAY_PORT}",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)',
        f'srun --het-group=0 --nodes=1 --ntasks=1 -w "$head" {_ray_start(pools[0], head=True)} &',
        "sleep 15",
    ]
    for k, pool in enumerate(pools):
        rest = pool.count - (1 if k == 0 else 0)
        if rest:
            exclude = ' --exclude="$head"' if k == 0 else ""
            lines.append(
                f"srun --het-group={k} --nodes={rest} --ntasks={rest}{exclude} {_ray_start(pool, head=False)} &"
            )
    total = sum(p.count for p in pools)
    lines += [
        f'until [ "$(ray status --address="$head:$port" 2>/dev/null | grep -c " node_")" -ge {total} ]; do sleep 5; done',
        'export RAY_ADDRESS="$head:$port"',
        command,
    ]
    return "\n".join(lines) + "\n"


def ray_job(plan, command: str, job_name: str) -> dict:
    """A Ray Jobs submission: the driver as the entrypoint, on the cluster's head."""
    return {
        "entrypoint": command,
        "submission_id": None,
        "runtime_env": {"env_vars": {"PYTHONUNBUFFERED": "1"}},
        "entrypoint_num_cpus": 1,
        "metadata": {
            "job_name": job_name,
            "model": plan.model,
            "needs": f"every node started with {TOKEN_ENV} exported and its pool's {POOL_RESOURCE}<pool> resource",
        },
    }


def skypilot_task(plan, recipe, job_name: str, command: str, repo: Path) -> dict:
    """A SkyPilot task: the plan's machines (one GPU type), Ray over them, the driver on the first."""
    pools = plan_pools(plan, recipe.cluster)
    pool = pools[0]
    total = sum(p.count for p in pools)
    resources = json.dumps({f"{POOL_RESOURCE}{p.pool}": 1 for p in pools})
    run = "\n".join(
        [
            "set -euo pipefail",
            f"port={RAY_PORT}",
            'head=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
            'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then',
            f"  ray start --head --port=$port --num-gpus={pool.gpus_per_machine} --resources={shlex.quote(resources)}",
            f'  until [ "$(ray status --address="$head:$port" 2>/dev/null | grep -c " node_")" -ge {total} ]; do sleep 5; done',
            f'  RAY_ADDRESS="$head:$port" {command}',
            "else",
            f'  ray start --address="$head:$port" --num-gpus={pool.gpus_per_machine} --resources={shlex.quote(resources)} --block',
            "fi",
        ]
    )
    return {
        "name": job_name,
        "num_nodes": total,
        "resources": {"accelerators": f"{pool.gpu_type}:{pool.gpus_per_machine}"},
        "workdir": str(repo),
        "secrets": {TOKEN_ENV: None},  # given at launch: sky launch --secret AREAL_HEX_TRANSPORT_TOKEN
        "envs": {"PYTHONUNBUFFERED": "1"},
        "setup": "pip install -e '.[areal]'",
        "run": run + "\n",
    }


def export(kind: str, out: str, plan, recipe, recipe_arg: str, overrides: list[str]) -> tuple[Path, Path]:
    """Write the job for ``kind`` at ``out`` and the plan beside it; returns both paths."""
    import yaml

    from areal_hex_plugin.outfiles import write_output

    job, plan_path = paths(out)
    command = driver_command(recipe_arg, overrides, plan_path)
    name = recipe.config.get("experiment_name") or f"hex-{Path(recipe_arg).stem}"
    if kind == "slurm":
        text = sbatch_script(plan, recipe, name, command, job.with_name(f"{job.stem}-%j.log"))
    elif kind == "ray":
        text = json.dumps(ray_job(plan, command, name), indent=2) + "\n"
    else:
        repo = Path(__file__).resolve().parents[2]
        text = yaml.safe_dump(skypilot_task(plan, recipe, name, command, repo), sort_keys=False, width=1000)
    plan.save(plan_path)
    write_output(job, text, "--export")
    return job, plan_path


def check_export(value: list[str] | None, recipe) -> None:
    """``--export KIND OUT``: a known kind for this cluster and a writable OUT, before solving."""
    from areal_hex_plugin.outfiles import check_writable

    if value is None:
        return
    kind, out = value
    if kind not in KINDS:
        raise HexError(
            "--export",
            f"unknown target {kind!r}",
            f"use one of {', '.join(KINDS)}, e.g. --export slurm job.sbatch",
        )
    types = recipe.cluster.gpu_types
    if kind == "skypilot" and len(types) != 1:
        raise HexError(
            "--export skypilot",
            f"SkyPilot launches one GPU type per task; this cluster has {', '.join(types)}",
            "export slurm or ray for a mixed cluster",
        )
    check_writable(out, "--export")
