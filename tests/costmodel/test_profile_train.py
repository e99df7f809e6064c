"""On CPU (gloo): the FSDP train-step measurement runs upstream's real PPO actor from the paper 1.5B recipe,
pointed at a tiny random Qwen2, on one and two ranks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

pytest.importorskip("areal")

from areal_hex_plugin.areal.config import load_hex_config  # noqa: E402
from areal_hex_plugin.areal.profile_train import measure_train  # noqa: E402
from areal_hex_plugin.costmodel.calibration import RANGES  # noqa: E402
from areal_hex_plugin.costmodel.fit import fit_profile  # noqa: E402
from areal_hex_plugin.errors import HexError  # noqa: E402
from areal_hex_plugin.specs.recipe import load_recipe  # noqa: E402
from tests.costmodel.helpers import TRUTH, pool_of, synthetic_measurements  # noqa: E402
from tests.transport.harness import small_qwen2  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "recipes/paper/1.5b.yaml"
KEYS = {
    "engine",
    "gpus",
    "sequences",
    "sequence_tokens",
    "tokens",
    "gradient_checkpointing",
    "logp_s",
    "step_s",
    "allreduce_bus_gb_per_s",
    "device_name",
}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile_train")
    small_qwen2(seed=3).save_pretrained(folder / "model")
    config, _ = load_hex_config(
        [
            "--config",
            str(RECIPE),
            f"actor.path={folder / 'model'}",
            "+actor.attn_impl=sdpa",  # the recipe's flash attention needs CUDA
            f"cluster.fileroot={folder / 'files'}",
            f"cluster.name_resolve.nfs_record_root={folder / 'names'}",
        ]
    )
    return config


# The recipe splits each rank's batch into actor.ppo_n_minibatches=4 minibatches, so each rank needs 4.
@pytest.mark.parametrize("gpus, sequences", [(1, 4), (2, 8)])
def test_measures_a_real_fsdp_step(recipe, gpus, sequences):
    result = measure_train(
        recipe, gpus=gpus, sequences=sequences, sequence_tokens=64, repeats=1, device="cpu"
    )
    assert set(result) == KEYS
    assert result["engine"] == "fsdp" and result["device_name"] == "cpu"
    assert (result["gpus"], result["sequences"], result["sequence_tokens"]) == (gpus, sequences, 64)
    assert result["tokens"] == sequences * 64
    assert result["gradient_checkpointing"] is True
    assert result["logp_s"] > 0 and result["step_s"] > 0
    if gpus == 1:
        assert result["allreduce_bus_gb_per_s"] is None
    else:
        assert result["allreduce_bus_gb_per_s"] > 0
    # What the real actor measured is what the fit reads: a CPU timed against H20 figures fits a tiny factor.
    r = load_recipe(RECIPE, [f"actor.path={recipe.actor.path}"])
    measured = synthetic_measurements(r, "H20", TRUTH, gpus=gpus)
    measured["train"] = {**result, "minibatches": recipe.actor.ppo_n_minibatches}
    fit = fit_profile(pool_of(r, "H20"), r.workload.model, measured)
    # The factor stops at the bottom of its physical range; the point shows the gap.
    assert fit.factors["train_mfu"] == RANGES["train_mfu"].low
    assert fit.points[-1]["measured_s"] == result["logp_s"] + result["step_s"] > fit.points[-1]["model_s"]
    assert fit.factors["hbm_fraction"] == pytest.approx(TRUTH["hbm_fraction"], rel=0.01)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(gpus=2, sequences=9), "--train-sequences"),  # not divisible over the ranks
        (dict(gpus=2, sequences=6), "--train-sequences"),  # 3 per rank, fewer than the 4 minibatches
        (
            dict(gpus=1, sequences=4, sequence_tokens=40000),
            "--train-sequence-tokens",
        ),  # over max_tokens_per_mb
        (dict(gpus=0, sequences=4), "--train-gpus"),
        (dict(gpus=1, sequences=4, device="tpu"), "device"),
    ],
)
def test_refuses_bad_input_before_starting_ranks(recipe, overrides, field):
    arguments = dict(sequence_tokens=64, device="cpu") | overrides
    with pytest.raises(HexError) as error:
        measure_train(recipe, **arguments)
    assert error.value.field == field


def test_a_failing_rank_is_one_clear_error(recipe, tmp_path):
    broken = copy.deepcopy(recipe)
    broken.actor.path = str(tmp_path / "missing")
    with pytest.raises(HexError) as error:
        measure_train(broken, gpus=2, sequences=8, sequence_tokens=64, repeats=1, device="cpu", timeout_s=300)
    assert error.value.field == "train" and "rank" in error.value.problem
