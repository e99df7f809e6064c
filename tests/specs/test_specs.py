"""GPU catalog, cluster links, model shapes and the output-length distribution."""

from __future__ import annotations

import json
import random

import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.catalog import BUILTIN_GPUS, build_catalog
from areal_hex_plugin.specs.models import BUILTIN_MODELS, from_hf_config, resolve_model
from areal_hex_plugin.specs.recipe import load_recipe
from areal_hex_plugin.specs.workload import LengthDistribution
from tests.conftest import RECIPES, REPO


def test_catalog_has_the_issue_types_with_sane_figures():
    catalog = build_catalog()
    for name in (
        "H800",
        "H800-PCIe",
        "H20",
        "H100",
        "H200",
        "A100-80GB",
        "A800",
        "L40S",
        "L20",
        "RTX4090",
        "B200",
    ):
        gpu = catalog.get(name)
        assert 100 <= gpu.tflops_bf16 <= 2500 and 20 <= gpu.hbm_gb <= 200 and 0.5 <= gpu.hbm_tb_per_s <= 8
    assert catalog.get("H800-PCIe").tflops_bf16 == 756 and catalog.get("H800-PCIe").hbm_tb_per_s == 2.0
    assert catalog.get("H20").hbm_tb_per_s / catalog.get("H20").tflops_bf16 > 5 * (
        catalog.get("H800").hbm_tb_per_s / catalog.get("H800").tflops_bf16
    )


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("NVIDIA H20", "H20"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA GeForce RTX 4090", "RTX4090"),
     ("h800_pcie", "H800-PCIe"), ("NVIDIA H100 80GB HBM3", "H100"), ("l40s", "L40S")],
)  # fmt: skip
def test_catalog_folds_vendor_spellings(spelling, name):
    assert build_catalog().canonical(spelling) == name


def test_catalog_overrides_and_additions():
    catalog = build_catalog(
        {
            "H20": {"hbm_gb": 141.0},
            "MI300X": {"tflops_bf16": 1307, "hbm_gb": 192, "hbm_tb_per_s": 5.3, "link_gb_per_s": 448},
        }
    )
    assert catalog.get("H20").hbm_gb == 141.0
    assert catalog.get("H20").tflops_bf16 == 148.0
    assert catalog.get("mi300x").hbm_tb_per_s == 5.3
    assert len(catalog.names) == len(BUILTIN_GPUS) + 1


def test_cluster_links_and_prices():
    recipe = load_recipe(
        REPO / "recipes/paper/7b.yaml", ["+hex.cluster.links=[{pools: [h800, h20], gb_per_s: 3.0}]"]
    )
    cluster = recipe.cluster
    assert cluster.link_gb_per_s("h800", "h20") == cluster.link_gb_per_s("h20", "h800") == 3.0
    assert cluster.link_gb_per_s("h20", "h20") == 5.0
    assert cluster.pool("h20").intra_machine_gb_per_s == 450.0  # catalog default
    assert cluster.price_per_hour == pytest.approx(32 * 5.28 + 72 * 1.85)
    assert cluster.pool("h800").host(2) == "h800-2"


@pytest.mark.parametrize(
    ("name", "billions"),
    [("DeepSeek-R1-Distill-Qwen-1.5B", 1.78), ("DeepSeek-R1-Distill-Qwen-7B", 7.62),
     ("DeepSeek-R1-Distill-Qwen-14B", 14.77), ("Qwen3-8B", 8.19), ("Llama-3.1-8B", 8.03), ("Llama-3.1-70B", 70.55)],
)  # fmt: skip
def test_parameter_counts_match_published_sizes(name, billions):
    assert BUILTIN_MODELS[name].params / 1e9 == pytest.approx(billions, abs=0.01)


def test_gqa_kv_width():
    m = BUILTIN_MODELS["DeepSeek-R1-Distill-Qwen-7B"]
    assert m.kv_width == 4 * 128
    assert m.kv_bytes_per_token() == 2 * 28 * 512 * 2


def test_model_from_local_hf_config(tmp_path):
    config = {
        "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
    }  # fmt: skip
    model_dir = tmp_path / "my-7b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    shape = resolve_model(str(model_dir), "actor.path")
    assert shape.name == "my-7b"
    assert shape.params == BUILTIN_MODELS["Qwen2.5-7B"].params
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct", "actor.path") == BUILTIN_MODELS["Qwen2.5-7B"]
    with pytest.raises(HexError, match="num_hidden_layers"):
        from_hf_config({"hidden_size": 8}, "x", "actor.path")


def test_lognormal_lengths_are_long_tailed_and_capped():
    d = LengthDistribution.lognormal(mean=4000, sigma=0.9, cap=16384)
    assert d.mean == pytest.approx(4000, rel=0.05)
    assert d.quantile(0.5) < d.mean < d.quantile(0.9)
    assert d.max == 16384
    sample = d.sample(random.Random(0), 1000)
    assert sample == d.sample(random.Random(0), 1000)
    assert min(sample) >= 1 and max(sample) <= 16384


def test_lengths_from_a_profiled_file(tmp_path):
    (tmp_path / "lengths.txt").write_text("100\n300\n200\n99999\n")
    recipe = load_recipe(
        REPO / "recipes/paper/1.5b.yaml",
        [f"hex.workload.output_lengths={{kind: file, path: {tmp_path / 'lengths.txt'}}}"],
    )
    assert recipe.workload.output_lengths.lengths == (100, 200, 300, 27648)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_validates(recipe, capsys):
    from areal_hex_plugin.cli import main

    assert main(["validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "tokens/step" in out
