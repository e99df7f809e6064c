"""Stand-ins for the commands an exported job calls (``sbatch``, ``srun``, ``scontrol``, ``ray``, the job's
``python``, ``sleep``): each records what it was asked, as one JSON line in ``$STUB_LOG``, and acts as far as a job
needs. ``sbatch`` runs the script with bash and the environment Slurm gives a (heterogeneous) job; ``srun`` runs its
command once per node it would start on; ``ray`` keeps the cluster's nodes in ``$STUB_STATE``; ``python`` is the
driver and exits ``$STUB_DRIVER_RC``; ``sleep`` returns at once. Run as ``python stub_schedulers.py NAME ARGS``
(``install`` writes the wrappers)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

NAMES = ("sbatch", "srun", "scontrol", "ray", "python", "sleep")


def install(folder: Path, names: tuple[str, ...] = NAMES) -> Path:
    """Write a wrapper per name into ``folder``; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        wrapper = folder / name
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {name} "$@"\n')
        wrapper.chmod(0o755)
    return folder


def calls(log: Path) -> list[dict]:
    """What the stubs were asked, in order."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _record(name: str, argv: list[str], **more) -> None:
    entry = {"cmd": name, "argv": argv, "node": os.environ.get("STUB_NODE"), **more}
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\n")


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(1)


def _expand(nodelist: str) -> list[str]:
    """``c0n[0-2],x`` -> ``c0n0 c0n1 c0n2 x`` (the forms the sbatch stub writes)."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        found = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", part)
        hosts += [f"{found[1]}{i}" for i in range(int(found[2]), int(found[3]) + 1)] if found else [part]
    return hosts


def _directives(script: Path) -> list[dict[str, str]]:
    """The ``#SBATCH`` options of each heterogeneous-job component (sbatch reads them up to the first command)."""
    components: list[dict[str, str]] = [{}]
    for line in script.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.strip() == "#SBATCH hetjob":
            components.append({})
        elif found := re.fullmatch(r"#SBATCH --([\w-]+)(?:=(\S+))?", line.strip()):
            components[-1][found[1]] = found[2] or ""
    return components


def sbatch(argv: list[str]) -> int:
    script = Path(argv[-1])
    components = _directives(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    lists = [c.get("nodelist") or f"c{k}n[0-{int(c['nodes']) - 1}]" for k, c in enumerate(components)]
    if len(components) == 1:
        env["SLURM_JOB_NODELIST"] = lists[0]
    else:
        env["SLURM_HET_SIZE"] = str(len(components))
        env.update({f"SLURM_JOB_NODELIST_HET_GROUP_{k}": nodes for k, nodes in enumerate(lists)})
    _record("sbatch", argv, components=components)
    return subprocess.run(["bash", str(script)], env=env).returncode


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"] or len(argv) != 3:
        _fail(f"scontrol stub: unexpected {argv}")
    print("\n".join(_expand(argv[2])))
    return 0


def srun(argv: list[str]) -> int:
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0].startswith("-"):
        word = rest.pop(0)
        if word == "-w":
            word = f"--nodelist={rest.pop(0)}"
        key, _, value = word.lstrip("-").partition("=")
        options[key] = value
    het = "SLURM_HET_SIZE" in os.environ
    if "het-group" in options and not het:
        _fail("srun: error: --het-group given in a job that is not heterogeneous")
    group = f"SLURM_JOB_NODELIST_HET_GROUP_{options.get('het-group', '0')}" if het else "SLURM_JOB_NODELIST"
    if group not in os.environ:
        _fail(f"srun: error: no allocation {group}")
    nodes = _expand(os.environ[group])
    if "nodelist" in options:
        if options["nodelist"] not in nodes:
            _fail(f"srun: error: {options['nodelist']} is not in {nodes}")
        nodes = [options["nodelist"]]
    nodes = [n for n in nodes if n != options.get("exclude")]
    wanted = int(options.get("ntasks", options.get("nodes", "1")))
    if len(nodes) < wanted:
        _fail(f"srun: error: {wanted} tasks asked, {len(nodes)} nodes left in {group}")
    _record("srun", argv, nodes=nodes[:wanted])
    codes = [subprocess.run(rest, env={**os.environ, "STUB_NODE": n}).returncode for n in nodes[:wanted]]
    return max(codes)


def ray(argv: list[str]) -> int:
    state = Path(os.environ["STUB_STATE"])
    up, members = state / "head.up", state / "nodes"
    if argv[0] == "start":
        if "--head" in argv:
            up.write_text(os.environ["STUB_NODE"])
        elif not up.exists():
            _record("ray", argv, ok=False)
            _fail("ray stub: no head at the address")
        with open(members, "a") as out:
            out.write(os.environ["STUB_NODE"] + "\n")
    elif argv[0] == "status":
        if not up.exists():
            return 1
        print("Active:\n" + "".join(f" 1 node_{n}\n" for n in members.read_text().split()))
    elif argv[0] == "stop" and up.exists() and up.read_text() == os.environ.get("STUB_NODE"):
        up.unlink()
    _record("ray", argv, ok=True)
    return 0


def python(argv: list[str]) -> int:
    _record("python", argv, cwd=os.getcwd(), ray_address=os.environ.get("RAY_ADDRESS"))
    return int(os.environ.get("STUB_DRIVER_RC", "0"))


def sleep(argv: list[str]) -> int:
    import time

    time.sleep(0.02)
    return 0


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    sys.exit(
        {"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "ray": ray, "python": python, "sleep": sleep}[
            name
        ](args)
    )
