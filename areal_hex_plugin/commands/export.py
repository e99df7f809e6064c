"""``areal-hex plan RECIPE --export slurm|ray|skypilot OUT``: a job that runs the driver with the plan.

The plan is written beside ``OUT`` (``<OUT stem>.plan.json``) and handed to the driver as ``hex.plan_path``, with the
command's own overrides, so the run is the plan shown. Every target runs the driver on a Ray cluster
(``scheduler.type=hex_ray``), each node started with its pool's ``hex_pool:<pool>`` resource, which pins the pool's
workers there:

- ``slurm``: an sbatch script: one job (one pool) or a heterogeneous job (one component per pool), each asking for
  its pool's GPU type as a typed GRES; it starts Ray over the allocation, then the driver, with the python (and the
  ``ray`` beside it) of this install or of ``--job-python``, and ends with the driver's status.
- ``ray``: a Ray Jobs submission (entrypoint + runtime_env, as ``ray job submit`` and ``JobSubmissionClient``
  take it) for a Ray cluster already up with the plan's machines; the driver runs on the head.
- ``skypilot``: a SkyPilot job group (``sky jobs launch``): one task per pool of the plan (one GPU type each, as
  SkyPilot's catalog names it), run in parallel; the recipe and plan travel as file mounts, the set-up installs the
  GPU profile, Ray spans the tasks and the driver runs on the first task's first node; when it ends the head stops
  Ray and every other node's run ends with it.

For slurm and ray the recipe, the plan and the install must be where the job runs (a shared file system, as AReaL's
NFS name_resolve needs anyway). The relay's token is never written: every machine must export it.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from areal_hex_plugin.errors import HexError

KINDS = ("slurm", "ray", "skypilot")
TOKEN_ENV = "AREAL_HEX_TRANSPORT_TOKEN"
POOL_RESOURCE = "hex_pool:"  # the Ray resource HexRayScheduler pins a pool's bundles with (schedulers/ray.py)
RAY_PORT = 6379
HEAD_RESOURCE = (
    "node:__internal_head__"  # Ray 2.x: a resource only the head node has (HEAD_NODE_RESOURCE_NAME)
)
JOIN_TIMEOUT_S = 600  # how long a job waits for Ray's nodes before it gives up
# Our catalog's names -> SkyPilot's accelerator names (its catalog's common/accelerators.csv, v8); a type missing
# here has no SkyPilot name (H800, H800-PCIe, H20, L20, H100-PCIe) and needs --accelerator-map.
SKYPILOT_ACCELERATORS = {
    "A10G": "A10G",
    "A100-40GB": "A100",
    "A100-80GB": "A100-80GB",
    "A800": "A800",
    "B200": "B200",
    "H100": "H100",
    "H200": "H200",
    "L4": "L4",
    "L40": "L40",
    "L40S": "L40S",
    "RTX4090": "RTX4090",
}
SKYPILOT_MOUNTS = "~/areal-hex"  # where a SkyPilot task's file mounts put the recipe and the plan
SKYPILOT_VENV = ".venv/bin"  # in the task's workdir: what scripts/setup.sh --gpu makes
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class PoolNodes:
    """The machines a plan uses in one pool."""

    pool: str
    gpu_type: str
    gpus_per_machine: int
    hosts: tuple[str, ...]  # the recipe's host names, or empty when it numbers its machines
    count: int


@dataclass(frozen=True)
class JobOptions:
    """What the command line says about the job beyond the plan: the interpreter (slurm, ray) and the names the
    target scheduler knows GPU types by (``--accelerator-map TYPE=NAME``, by catalog name)."""

    python: str = sys.executable
    names: tuple[tuple[str, str], ...] = ()

    def name_for(self, gpu_type: str) -> str | None:
        return dict(self.names).get(gpu_type)


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


def driver_command(python: str, recipe: str, overrides: list[str], plan_path: str) -> str:
    """The driver (``python``: a shell word, quoted as needed) on the recipe with the command's overrides and the
    saved plan, on the Ray scheduler."""
    words = ["-m", "areal_hex_plugin.driver", "--config", recipe, *overrides]
    return f"{python} {shlex.join([*words, f'hex.plan_path={plan_path}', 'scheduler.type=hex_ray'])}"


def _ray_args(pool: PoolNodes) -> str:
    """``ray start`` options every node of ``pool`` takes: its GPUs and its pool's resource."""
    resources = json.dumps({f"{POOL_RESOURCE}{pool.pool}": 1})
    return f"--num-gpus={pool.gpus_per_machine} --resources={shlex.quote(resources)}"


def _wait_for_nodes(ray: str) -> list[str]:
    """A shell function, ``wait_for_nodes N``: until N nodes are in the Ray cluster at ``$head:$port``, bounded."""
    return [
        f"wait_for_nodes() {{  # until $1 nodes are in the Ray cluster, at most {JOIN_TIMEOUT_S} s",
        f"  local deadline=$((SECONDS + {JOIN_TIMEOUT_S})) joined",
        "  while :; do",
        f'    joined=$({ray} status --address="$head:$port" 2>/dev/null | grep -c " node_" || true)',
        '    [ "$joined" -ge "$1" ] && return 0',
        '    if [ "$SECONDS" -ge "$deadline" ]; then',
        f'      echo "only $joined of $1 nodes joined Ray in {JOIN_TIMEOUT_S} s" >&2',
        "      exit 1",
        "    fi",
        "    sleep 5",
        "  done",
        "}",
    ]


def gres_type(pool: PoolNodes, options: JobOptions) -> str:
    """The GRES type a Slurm site names the pool's GPUs by: ``--accelerator-map``, else the catalog name in lower
    case (``H800-PCIe`` -> ``h800-pcie``)."""
    return options.name_for(pool.gpu_type) or pool.gpu_type.lower()


def _sbatch_header(pools: list[PoolNodes], job_name: str, log: Path, options: JobOptions) -> list[str]:
    lines = []
    for k, pool in enumerate(pools):
        if k:
            lines.append("#SBATCH hetjob")
        if k == 0:
            lines += [f"#SBATCH --job-name={job_name}", f"#SBATCH --output={log}"]
        lines += [
            f"#SBATCH --nodes={pool.count}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gres=gpu:{gres_type(pool, options)}:{pool.gpus_per_machine}",
            "#SBATCH --exclusive",
        ]
        if pool.hosts:
            lines.append(f"#SBATCH --nodelist={','.join(pool.hosts)}")
        lines.append(f"# pool {pool.pool}: {pool.count} x {pool.gpus_per_machine} {pool.gpu_type}")
    return lines


def sbatch_script(plan, recipe, job_name: str, command: str, log: Path, options: JobOptions) -> str:
    """The sbatch script: one job (one pool) or a heterogeneous job (a component per pool), Ray over it, then the
    driver, whose status the job ends with."""
    pools = plan_pools(plan, recipe.cluster)
    het = len(pools) > 1

    def srun(k: int) -> str:
        return f"srun --het-group={k}" if het else "srun"

    nodelist = "$SLURM_JOB_NODELIST_HET_GROUP_0" if het else "$SLURM_JOB_NODELIST"
    lines = [
        "#!/bin/bash",
        f"# AReaL-Hex: {plan.model} with the plan beside this script (areal-hex plan --export slurm).",
        "# One component per pool of the plan, its GPUs typed as your site's GRES names them (--accelerator-map",
        "# TYPE=NAME re-exports with another name); Ray over the nodes, the driver on the first.",
        *_sbatch_header(pools, job_name, log, options),
        "",
        "set -euo pipefail",
        f': "${{{TOKEN_ENV}:?export {TOKEN_ENV} (e.g. openssl rand -hex 16) before sbatch}}"',
        "export PYTHONUNBUFFERED=1",
        f"python={shlex.quote(options.python)}  # the install the driver runs from",
        'ray="$(dirname "$python")/ray"  # and its Ray',
        f"port={RAY_PORT}",
        f'head=$(scontrol show hostnames "{nodelist}" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail',
        *_wait_for_nodes('"$ray"'),
        f'{srun(0)} --nodes=1 --ntasks=1 -w "$head" "$ray" start --head --port=$port {_ray_args(pools[0])} --block &',
        "wait_for_nodes 1",
    ]
    for k, pool in enumerate(pools):
        rest = pool.count - (1 if k == 0 else 0)
        if rest:
            exclude = ' --exclude="$head"' if k == 0 else ""
            lines.append(
                f'{srun(k)} --nodes={rest} --ntasks={rest}{exclude} "$ray" start --address="$head:$port" '
                f"{_ray_args(pool)} --block &"
            )
    lines += [
        f"wait_for_nodes {sum(p.count for p in pools)}",
        'export RAY_ADDRESS="$head:$port"',
        command,
    ]
    return "\n".join(lines) + "\n"


def ray_job(plan, command: str, job_name: str) -> dict:
    """A Ray Jobs submission: the driver as the entrypoint, pinned to the cluster's head (asking for any other
    resource would let Ray start it on any node)."""
    return {
        "entrypoint": command,
        "submission_id": None,
        "runtime_env": {"env_vars": {"PYTHONUNBUFFERED": "1"}},
        "entrypoint_resources": {HEAD_RESOURCE: 0.001},
        "metadata": {
            "job_name": job_name,
            "model": plan.model,
            "needs": f"every node started with {TOKEN_ENV} exported and its pool's {POOL_RESOURCE}<pool> resource",
        },
    }


def skypilot_accelerator(pool: PoolNodes, options: JobOptions) -> str:
    """SkyPilot's name for the pool's GPUs, or an error naming ``--accelerator-map``."""
    name = options.name_for(pool.gpu_type) or SKYPILOT_ACCELERATORS.get(pool.gpu_type)
    if name is None:
        raise HexError(
            "--export skypilot",
            f"SkyPilot's catalog has no name for {pool.gpu_type} (pool {pool.pool})",
            f"give the name your SkyPilot infra uses (a Kubernetes GPU label, say): "
            f"--accelerator-map {pool.gpu_type}=NAME",
        )
    return name


def _skypilot_name(name: str) -> str:
    """A name SkyPilot takes for a job group or a task (letters, digits, '-' and '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)


def _skypilot_run(pool: PoolNodes, head_task: str, head: tuple[int, str] | None) -> str:
    """A task's run. Rank 0 of the head task (``head``: the cluster's node count and the driver command) starts
    Ray, waits for every node, runs the driver and stops Ray; every other node joins and stays until that cluster
    is gone."""
    ray = '"$venv/ray"'
    lines = [
        "set -euo pipefail",
        f'venv="$PWD/{SKYPILOT_VENV}"  # made by the set-up in the workdir',
        f"port={RAY_PORT}",
        f'head="{head_task}-0.$SKYPILOT_JOBGROUP_NAME"  # rank 0 of task {head_task}, as the job group names it',
    ]
    if head:
        total, command = head
        lines += [
            *_wait_for_nodes(ray),
            'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then',
            f"  {ray} start --head --port=$port {_ray_args(pool)}",
            f"  wait_for_nodes {total}",
            "  rc=0",
            f'  (cd {SKYPILOT_MOUNTS} && RAY_ADDRESS="$head:$port" {command}) || rc=$?',
            f"  {ray} stop",
            "  exit $rc",
            "fi",
        ]
    lines += [
        f"deadline=$((SECONDS + {JOIN_TIMEOUT_S}))",
        f'until {ray} start --address="$head:$port" {_ray_args(pool)}; do',
        '  [ "$SECONDS" -lt "$deadline" ] || { echo "no Ray head at $head:$port" >&2; exit 1; }',
        "  sleep 5",
        "done",
        f'while {ray} status --address="$head:$port" >/dev/null 2>&1; do sleep 30; done',
        f"{ray} stop",
    ]
    return "\n".join(lines) + "\n"


def skypilot_job_group(
    plan, recipe, job_name: str, recipe_arg: str, overrides: list[str], plan_path: Path, options: JobOptions
) -> list[dict]:
    """A SkyPilot job group: its header, then one task per pool of the plan, in parallel; the first pool's task is
    the primary one (its end ends the group)."""
    pools = plan_pools(plan, recipe.cluster)
    recipe_path = Path(recipe_arg).absolute()
    mounts = {
        f"{SKYPILOT_MOUNTS}/{recipe_path.name}": str(recipe_path),
        f"{SKYPILOT_MOUNTS}/{plan_path.name}": str(plan_path),
    }
    command = driver_command('"$venv/python"', recipe_path.name, overrides, plan_path.name)
    head_task = _skypilot_name(pools[0].pool)
    header = {"name": _skypilot_name(job_name), "execution": "parallel", "primary_tasks": [head_task]}
    secrets = {TOKEN_ENV: None}  # given at launch: sky jobs launch --secret AREAL_HEX_TRANSPORT_TOKEN
    tasks = [
        {
            "name": _skypilot_name(pool.pool),
            "num_nodes": pool.count,
            "resources": {"accelerators": f"{skypilot_accelerator(pool, options)}:{pool.gpus_per_machine}"},
            "workdir": str(_source_checkout()),
            "file_mounts": mounts,
            "secrets": secrets,
            "envs": {"PYTHONUNBUFFERED": "1"},
            "setup": "bash scripts/setup.sh --gpu",
            "run": _skypilot_run(pool, head_task, (sum(p.count for p in pools), command) if k == 0 else None),
        }
        for k, pool in enumerate(pools)
    ]
    return [header, *tasks]


def _source_checkout() -> Path:
    """The plugin's source checkout, which a SkyPilot task takes as its workdir and installs with its set-up."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "scripts/setup.sh").is_file():
        raise HexError(
            "--export skypilot",
            f"the task installs the plugin from its source checkout (scripts/setup.sh); {root} has none",
            "run areal-hex from a clone of the repository (bash scripts/setup.sh), or export slurm or ray",
        )
    return root


def export(
    kind: str, out: str, plan, recipe, recipe_arg: str, overrides: list[str], options: JobOptions
) -> tuple[Path, Path]:
    """Write the job for ``kind`` at ``out`` and the plan beside it; returns both paths."""
    from areal_hex_plugin.outfiles import write_output

    job, plan_path = paths(out)
    name = recipe.config.get("experiment_name") or f"hex-{Path(recipe_arg).stem}"
    recipe_path = str(Path(recipe_arg).absolute())
    command = driver_command(shlex.quote(options.python), recipe_path, overrides, str(plan_path))
    if kind == "slurm":
        command = driver_command('"$python"', recipe_path, overrides, str(plan_path))
        text = sbatch_script(plan, recipe, name, command, job.with_name(f"{job.stem}-%j.log"), options)
    elif kind == "ray":
        text = json.dumps(ray_job(plan, command, name), indent=2) + "\n"
    else:
        documents = skypilot_job_group(plan, recipe, name, recipe_arg, overrides, plan_path, options)
        text = yaml_documents(documents)
    plan.save(plan_path)
    write_output(job, text, "--export")
    return job, plan_path


def yaml_documents(documents: list[dict]) -> str:
    """The documents as one YAML stream, multi-line strings (a task's run) as literal blocks."""
    import yaml

    class BlockDumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    BlockDumper.add_representer(str, text)
    return yaml.dump_all(documents, Dumper=BlockDumper, sort_keys=False, width=1000)


def job_options(export_value: list[str] | None, python: str | None, pairs: list[str], recipe) -> JobOptions:
    """``--export KIND OUT``, ``--job-python`` and ``--accelerator-map``, checked before solving."""
    from areal_hex_plugin.outfiles import check_writable

    if export_value is None:
        for flag, given in (("--job-python", python), ("--accelerator-map", pairs)):
            if given:
                raise HexError(
                    flag, "goes with --export", f"add --export slurm|ray|skypilot OUT, or drop {flag}"
                )
        return JobOptions()
    kind, out = export_value
    if kind not in KINDS:
        raise HexError(
            "--export",
            f"unknown target {kind!r}",
            f"use one of {', '.join(KINDS)}, e.g. --export slurm job.sbatch",
        )
    if kind == "skypilot" and python:
        raise HexError(
            "--job-python",
            "the SkyPilot task installs its own python (scripts/setup.sh --gpu in its workdir)",
            "drop --job-python, or export slurm or ray",
        )
    names = tuple(_accelerator_pair(pair, recipe) for pair in pairs)
    check_writable(out, "--export")
    return JobOptions(python or sys.executable, names)


def _accelerator_pair(pair: str, recipe) -> tuple[str, str]:
    """``TYPE=NAME`` -> (the catalog's name for TYPE, NAME), TYPE one of the recipe's GPU types."""
    gpu_type, _, name = pair.partition("=")
    if not NAME.fullmatch(name):
        raise HexError(
            "--accelerator-map", f"{pair!r} is not TYPE=NAME", "e.g. --accelerator-map H800-PCIe=H800"
        )
    canonical = recipe.catalog.canonical(gpu_type)
    types = recipe.cluster.gpu_types
    if canonical not in types:
        raise HexError(
            "--accelerator-map",
            f"{gpu_type!r} is not a GPU type of this recipe's cluster",
            f"map one of {', '.join(types)}",
        )
    return canonical, name
