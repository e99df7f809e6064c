"""Legal but suspicious settings are warnings with a fix; defaults that change the result are said out loud."""

from __future__ import annotations

import yaml

from areal_hex_plugin.cli import main
from areal_hex_plugin.specs.advice import recipe_notes
from areal_hex_plugin.specs.recipe import load_recipe
from tests.conftest import REPO

MINIMAL = {
    "actor": {"path": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"},
    "hex": {
        "cluster": {
            "pools": [
                {
                    "name": "a",
                    "gpu_type": "H100",
                    "gpus_per_machine": 8,
                    "machines": 2,
                    "price_per_gpu_hour": 3,
                },
                {
                    "name": "b",
                    "gpu_type": "L40S",
                    "gpus_per_machine": 8,
                    "machines": 2,
                    "price_per_gpu_hour": 1,
                },
            ]
        },
        "workload": {"output_lengths": {"kind": "lognormal", "mean_tokens": 1000}},
    },
}


def _minimal(tmp_path, **extra):
    path = tmp_path / "minimal.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, **extra}))
    return path


def _fields(notes, kind):
    return {n.field for n in notes if n.kind == kind}


def test_a_minimal_recipe_warns_about_its_one_by_one_step_and_names_every_default(tmp_path, capsys):
    notes = recipe_notes(load_recipe(_minimal(tmp_path)))
    assert _fields(notes, "warning") == {
        "train_dataset.batch_size x gconfig.n_samples",
        "gconfig.n_samples",
        "rollout.max_head_offpolicyness",
    }
    assert _fields(notes, "default") >= {
        "hex.cluster.cross_pool_gb_per_s",  # the paper's 1.5 GB/s, silently, before
        "hex.cluster.pools.0.inter_machine_gb_per_s",
        "hex.workload.prompt_tokens",
    }
    step = next(n for n in notes if n.field.startswith("train_dataset"))
    assert "1 prompt(s) x 1 sample(s)" in step.text and "upstream's default" in step.text and step.fix
    assert all(n.fix for n in notes)
    # A warning is not an error: the command still plans, and stdout stays clean for data.
    assert main(["validate", str(_minimal(tmp_path))]) == 0
    captured = capsys.readouterr()
    assert "warning: gconfig.n_samples" in captured.err and "1.5 GB/s" in captured.err
    assert "warning" not in captured.out


def test_settings_that_are_given_are_not_called_defaults(tmp_path):
    recipe = dict(
        MINIMAL,
        train_dataset={"batch_size": 64, "max_length": 1024},
        gconfig={"n_samples": 8, "max_new_tokens": 1500},
        rollout={"max_head_offpolicyness": 4},
    )
    recipe["hex"] = dict(MINIMAL["hex"], objective={"budget_per_hour": 1000})
    recipe["hex"]["cluster"] = dict(MINIMAL["hex"]["cluster"], cross_pool_gb_per_s=3.0)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    notes = recipe_notes(load_recipe(path))
    assert _fields(notes, "warning") == {"gconfig.max_new_tokens", "hex.objective.budget_per_hour"}
    assert "hex.cluster.cross_pool_gb_per_s" not in _fields(notes, "default")


def test_the_recipes_people_start_from_raise_no_warning():
    for path in sorted((REPO / "recipes").glob("*/*.yaml")):
        warned = _fields(recipe_notes(load_recipe(path)), "warning")
        if path.parent.name == "ci":  # deliberately tiny, so that CI runs in minutes: the warnings say so
            assert "train_dataset.batch_size x gconfig.n_samples" in warned, path
        else:
            assert warned == set(), path
