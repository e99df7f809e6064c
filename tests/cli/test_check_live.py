"""``areal-hex check`` against a REAL local Ray cluster (one node, fake GPUs): a plan for seven machines is refused
when the live cluster has one, as the driver would refuse it before starting anything."""

from __future__ import annotations

import re

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("areal")

from areal_hex_plugin.cli import main  # noqa: E402
from tests.conftest import REPO  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("transport_token")]

SEVEN_H20 = """    pools:
      - name: h20
        gpu_type: H20
        gpus_per_machine: 8
        machines: 7
        price_per_gpu_hour: 1.85
        inter_machine_gb_per_s: 5.0
    cross_pool_gb_per_s"""


@pytest.fixture(scope="module")
def one_h20_node():
    """A live Ray cluster of one machine with 8 (fake) H20 GPUs."""
    ray.init(
        address="local",
        num_cpus=1,
        num_gpus=8,
        resources={"accelerator_type:H20": 1},
        include_dashboard=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_a_live_ray_cluster_missing_six_of_seven_machines_is_refused(one_h20_node, tmp_path, capsys) -> None:
    text = (REPO / "recipes/paper/1.5b.yaml").read_text()
    head, rest = text.split("    pools:\n", 1)
    recipe = tmp_path / "seven-h20.yaml"
    recipe.write_text(head + SEVEN_H20 + rest.split("    cross_pool_gb_per_s", 1)[1])
    argv = ["check", str(recipe), "~hex.objective.budget_per_hour", "scheduler.type=hex_ray"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    used = re.search(
        r"hex\.plan_path: the plan uses (\d+) H20 machines but the live ray cluster has 1\n", err
    )
    assert used and int(used.group(1)) > 1, err
    # The same recipe checked away from the cluster passes: only the live inventory was wrong.
    assert main([*argv, "--offline"]) == 0
