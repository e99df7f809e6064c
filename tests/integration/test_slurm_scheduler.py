"""HexSlurmScheduler: golden sbatch scripts for a two-GPU-type plan (no Slurm here: ``sbatch`` is a recorder)."""

from __future__ import annotations

import getpass
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal.api.cli_args import SchedulingSpec  # noqa: E402
from areal.api.scheduler_api import Job  # noqa: E402
from areal.infra.scheduler.exceptions import WorkerCreationError  # noqa: E402

from areal_hex_plugin.areal.schedulers.slurm import (  # noqa: E402
    HexSlurmScheduler,
    SlurmPool,
    slurm_pools_from_sinfo,
)
from areal_hex_plugin.areal.worker_slots import placement_from_plan  # noqa: E402
from areal_hex_plugin.inventory import machines_from_sinfo  # noqa: E402
from tests.integration.plans import session_of, two_type_plan  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
POOLS = {
    "big": SlurmPool(gpus_per_node=2, gres_type="h100", partition="train"),
    "small": SlurmPool(gpus_per_node=2, gres_type=None, partition="infer", constraint="l40s"),
}
SINFO = """big-0|gpu:h100:2|h100|train
big-1|gpu:h100:2|h100|train*
small-0|gpu:2|l40s,eth|infer
small-1|gpu:2|l40s,eth|infer
"""


def _spec(container: str = "native") -> SchedulingSpec:
    return SchedulingSpec(
        cpu=4,
        gpu=1,
        mem=16,
        port_count=2,
        cmd="python3 -m areal.infra.rpc.rpc_server",
        env_vars={"A": "x y"},
        container_type=container,
        image="/images/areal.sif",
        mount="/data:/data",
    )


@pytest.fixture
def scheduler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HexSlurmScheduler:
    # A recording sbatch on PATH: keeps the script, answers like Slurm.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        '#!/bin/sh\ncp "$1" "$(dirname "$1")/submitted-$(basename "$1")"\necho "Submitted batch job 42"\n'
    )
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (tmp_path / "nr").mkdir()
    return HexSlurmScheduler(
        placement_from_plan(two_type_plan()),
        POOLS,
        experiment_name="hexexp",
        trial_name="t0",
        fileroot=str(tmp_path),
        nfs_record_root=str(tmp_path / "nr"),
    )


@pytest.mark.integration
@pytest.mark.parametrize(("role", "replicas"), [("actor", 2), ("rollout", 6)])
def test_sbatch_matches_golden(
    scheduler: HexSlurmScheduler, tmp_path: Path, role: str, replicas: int
) -> None:
    ids = scheduler.create_workers(Job(role=role, replicas=replicas, tasks=[_spec()]))
    assert ids == [f"{role}/{i}" for i in range(replicas)]
    script = Path(scheduler._sbatch_path_of(role))
    submitted = script.with_name(f"submitted-{script.name}").read_text()
    user = getpass.getuser()
    got = submitted.replace(str(tmp_path), "<FILEROOT>").replace(f"/logs/{user}/", "/logs/<USER>/")
    # Upstream forwards the controller's own PYTHONPATH and per-user cache folders: machine-specific.
    got = re.sub(r"export PYTHONPATH=[^;]*;", "export PYTHONPATH=<PYTHONPATH>;", got)
    got = got.replace(f"/tmp/areal-{user}/.cache/{user}/", "<CACHE>/")
    golden = GOLDEN / f"slurm_{role}.sbatch"
    if os.environ.get("HEX_UPDATE_GOLDEN"):
        golden.write_text(got)
    assert got == golden.read_text()


@pytest.mark.integration
def test_rollout_script_has_one_typed_component_per_pool(scheduler: HexSlurmScheduler) -> None:
    scheduler.create_workers(Job(role="rollout", replicas=6, tasks=[_spec()]))
    text = Path(scheduler._sbatch_path_of("rollout")).read_text()
    assert text.count("#SBATCH hetjob") == 1
    assert "#SBATCH --gres=gpu:h100:2" in text and "#SBATCH --nodelist=big-1" in text
    assert "#SBATCH --constraint=l40s" in text and "#SBATCH --nodelist=small-0,small-1" in text
    assert "export HEX_GPU_TYPE=L40S" in text and "export A='\"'\"'x y'\"'\"'" in text


@pytest.mark.integration
def test_apptainer_spec_runs_each_task_in_its_image(scheduler: HexSlurmScheduler) -> None:
    scheduler.create_workers(Job(role="actor", replicas=2, tasks=[_spec("apptainer")]))
    text = Path(scheduler._sbatch_path_of("actor")).read_text()
    assert (
        "singularity exec --no-home --writable-tmpfs --nv --bind /data:/data /images/areal.sif bash -c"
        in text
    )


@pytest.mark.integration
def test_wrong_replica_count_submits_nothing(scheduler: HexSlurmScheduler) -> None:
    with pytest.raises(WorkerCreationError, match="plan places 2"):
        scheduler.create_workers(Job(role="actor", replicas=3, tasks=[_spec()]))
    assert not Path(scheduler._sbatch_path_of("actor")).exists()


def test_pools_read_off_sinfo() -> None:
    pools = slurm_pools_from_sinfo(placement_from_plan(two_type_plan()), machines_from_sinfo(SINFO), {})
    assert pools == {
        "big": SlurmPool(gpus_per_node=2, gres_type="h100", partition="train"),
        "small": SlurmPool(gpus_per_node=2, gres_type=None, partition="infer", constraint="l40s"),
    }


@pytest.mark.integration
def test_factory_reads_sinfo_and_refuses_a_missing_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from areal_hex_plugin.areal.config import HexGRPOConfig
    from areal_hex_plugin.areal.launch import scheduler_factory
    from areal_hex_plugin.errors import HexError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    config = HexGRPOConfig(experiment_name="hexexp", trial_name="t0")
    config.scheduler.type = "hex_slurm"
    config.cluster.fileroot = str(tmp_path)
    config.cluster.name_resolve.nfs_record_root = str(tmp_path)
    plan = two_type_plan()

    sinfo.write_text(f"#!/bin/sh\ncat <<'END'\n{SINFO}END\n")
    sinfo.chmod(0o755)
    scheduler = scheduler_factory(session_of(config, plan))()
    assert isinstance(scheduler, HexSlurmScheduler)
    assert scheduler.pools["small"] == POOLS["small"]

    h100_only = "\n".join(SINFO.splitlines()[:2])
    sinfo.write_text(f"#!/bin/sh\ncat <<'END'\n{h100_only}\nEND\n")
    with pytest.raises(HexError, match="needs L40S machines but the live slurm cluster has none"):
        scheduler_factory(session_of(config, plan))


def test_one_machine_with_servers_of_two_layouts_is_refused_before_sbatch() -> None:
    from areal_hex_plugin.areal.schedulers.slurm import check_slurm_placement
    from areal_hex_plugin.areal.worker_slots import Placement, WorkerSlot
    from areal_hex_plugin.errors import HexError

    slots = (
        WorkerSlot("rollout", 0, "big", "H100", "big-1", (0, 1), 0.5, tp=2),
        WorkerSlot("rollout", 1, "big", "H100", "big-1", (2,), 0.5),
    )
    placement = Placement({"rollout": slots}, train_dp=1, train_tp=1, train_pp=1)
    with pytest.raises(HexError, match="runs workers of \\[1, 2\\] GPUs") as err:
        check_slurm_placement(placement)
    assert "hex_ray" in err.value.fix
    check_slurm_placement(placement_from_plan(two_type_plan(big_tp=2)))  # one layout per machine is fine
