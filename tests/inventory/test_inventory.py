"""Inventory discovery: Slurm and NVML parsing against recorded outputs, Ray against a real local cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.inventory import (
    group_pools,
    machines_from_declared,
    machines_from_nvidia_smi,
    machines_from_ray_nodes,
    machines_from_sinfo,
    render_cluster_yaml,
)
from areal_hex_plugin.specs.catalog import build_catalog
from areal_hex_plugin.specs.cluster import build_cluster
from areal_hex_plugin.specs.config import ClusterConfig
from areal_hex_plugin.specs.typed import build

DATA = Path(__file__).parent / "data"


def _load_cluster(text: str, price: float | None):
    section = yaml.safe_load(text)["hex"]["cluster"]
    for pool in section["pools"]:
        pool["price_per_gpu_hour"] = price
    return build_cluster(build(ClusterConfig, section, "hex.cluster"), build_catalog())


def test_sinfo_groups_typed_and_feature_gres_into_pools() -> None:
    pools = group_pools(machines_from_sinfo((DATA / "sinfo_two_types.txt").read_text()))
    got = {(p.name, p.gpu_type, p.gpus_per_machine, p.hosts, p.partitions) for p in pools}
    assert got == {
        ("a100-80gb", "A100-80GB", 8, ("gpu-a01", "gpu-a02"), ("gpu", "long")),
        ("l40s-x8", "L40S", 8, ("gpu-l01", "gpu-l02"), ("inference",)),
        ("l40s-x4", "L40S", 4, ("gpu-l03",), ("inference",)),
    }


def test_sinfo_untyped_gres_without_gpu_feature_is_a_clear_error() -> None:
    with pytest.raises(HexError, match="sinfo node n1") as err:
        machines_from_sinfo("n1|gpu:4|ib,nvme|batch\n")
    assert "Gres=gpu:<type>:<n>" in err.value.fix


def test_sinfo_wrong_format_names_the_line() -> None:
    with pytest.raises(HexError, match="sinfo line 2"):
        machines_from_sinfo("n1|gpu:h100:8|h100|batch\nn2 gpu:h100:8\n")


def test_nvidia_smi_single_type_is_one_machine() -> None:
    machines = machines_from_nvidia_smi((DATA / "nvidia_smi_h100x8.txt").read_text(), "box")
    pools = group_pools(machines)
    assert [(p.name, p.gpu_type, p.gpus_per_machine, p.hosts) for p in pools] == [
        ("h100", "H100", 8, ("box",))
    ]


def test_nvidia_smi_mixed_machine_normalises_names_through_the_catalog() -> None:
    pools = group_pools(machines_from_nvidia_smi((DATA / "nvidia_smi_mixed.txt").read_text(), "box"))
    assert {(p.gpu_type, p.gpus_per_machine) for p in pools} == {("A100-80GB", 2), ("RTX4090", 1)}
    assert all(p.known_type for p in pools)


def test_rendered_yaml_marks_prices_and_loads_once_they_are_filled_in() -> None:
    text = render_cluster_yaml(
        group_pools(machines_from_sinfo((DATA / "sinfo_two_types.txt").read_text())), "slurm"
    )
    assert text.count("price_per_gpu_hour: null  # FILL IN") == 3
    with pytest.raises(HexError, match=r"price_per_gpu_hour: is missing"):
        _load_cluster(text, None)
    cluster = _load_cluster(text, 2.0)
    assert cluster.n_gpus == 8 * 2 + 8 * 2 + 4


def test_unknown_gpu_type_is_kept_and_flagged() -> None:
    text = render_cluster_yaml(
        group_pools(machines_from_nvidia_smi("0, NVIDIA Foo 9000, 1 MiB\n", "h")), "local"
    )
    assert "'NVIDIA Foo 9000' is not in the catalog" in text


def test_ray_node_with_gpus_but_no_type_is_a_clear_error() -> None:
    node = {"Alive": True, "NodeID": "ab" * 20, "Resources": {"GPU": 4.0, "CPU": 8.0}}
    with pytest.raises(HexError, match="accelerator_type"):
        machines_from_ray_nodes([node])


def test_cli_without_nvidia_smi_exits_2_without_traceback(tmp_path: Path) -> None:
    out = tmp_path / "inv.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "areal_hex_plugin.cli", "inventory", "--from", "local", "--out", str(out)],
        capture_output=True,
        text=True,
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert proc.returncode == 2
    assert "nvidia-smi is not on PATH" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_cli_local_reads_nvidia_smi(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ncat {DATA / 'nvidia_smi_h100x8.txt'}\n")
    fake.chmod(0o755)
    out = tmp_path / "inv.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "areal_hex_plugin.cli", "inventory", "--from", "local", "--out", str(out)],
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    cluster = _load_cluster(out.read_text(), 3.0)
    assert [(p.gpu_type, p.n_gpus) for p in cluster.pools] == [("H100", 8)]


def test_cli_local_takes_the_gpus_hex_local_gpus_declares(tmp_path: Path) -> None:
    out = tmp_path / "inv.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "areal_hex_plugin.cli", "inventory", "--from", "local", "--out", str(out)],
        capture_output=True,
        text=True,
        env={"PATH": str(tmp_path), "HOME": str(tmp_path), "HEX_LOCAL_GPUS": "H100:3, NVIDIA L40S:1"},
    )
    assert proc.returncode == 0, proc.stderr  # no nvidia-smi on PATH: the declaration is enough
    cluster = _load_cluster(out.read_text(), 3.0)
    assert sorted((p.gpu_type, p.n_gpus) for p in cluster.pools) == [("H100", 3), ("L40S", 1)]


@pytest.mark.parametrize("declared", ["H100", "H100:0", "H100:2,:1", "H100:two"])
def test_a_bad_hex_local_gpus_names_the_variable(declared: str) -> None:
    with pytest.raises(HexError, match="HEX_LOCAL_GPUS") as caught:
        machines_from_declared(declared, "h")
    assert "TYPE:N" in caught.value.message


@pytest.mark.integration
@pytest.mark.slow
def test_cli_reads_a_real_local_ray_cluster_with_fake_gpu_nodes(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, num_gpus=4, resources={"accelerator_type:H100": 1})
        cluster.add_node(num_cpus=1, num_gpus=8, resources={"accelerator_type:L40S": 1})
        cluster.wait_for_nodes()
        out = tmp_path / "inv.yaml"
        proc = subprocess.run(
            [sys.executable, "-m", "areal_hex_plugin.cli", "inventory", "--from", "ray"]
            + ["--address", cluster.address, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        built = _load_cluster(out.read_text(), 1.0)
        assert sorted((p.gpu_type, p.gpus_per_machine, p.machines) for p in built.pools) == [
            ("H100", 4, 2),
            ("L40S", 8, 1),
        ]
    finally:
        cluster.shutdown()
