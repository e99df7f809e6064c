"""``areal-hex catalog``: every GPU figure with its source, the common cloud GPUs, the built-in models."""

from __future__ import annotations

import json

import jsonschema
import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.schemas import load_schema
from areal_hex_plugin.specs.catalog import BUILTIN_GPUS, FIGURES, build_catalog
from areal_hex_plugin.specs.models import BUILTIN_MODELS


def test_every_figure_of_every_gpu_names_its_source():
    for gpu in BUILTIN_GPUS:
        assert all(gpu.source(f) for f in FIGURES), gpu.name


@pytest.mark.parametrize(
    ("spelling", "figures"),
    [
        ("NVIDIA A10G", ("A10G", 70, 24, 0.6, 32)),  # AWS g5
        ("NVIDIA L4", ("L4", 121, 24, 0.3, 32)),  # GCP g2; the datasheet's 242 is with sparsity
        ("NVIDIA A100-SXM4-40GB", ("A100-40GB", 312, 40, 1.555, 300)),
        ("NVIDIA H100 PCIe", ("H100-PCIe", 756, 80, 2.0, 64)),  # NVLink bridges pair cards; PCIe Gen5 between
        ("NVIDIA L40", ("L40", 181, 48, 0.864, 32)),
    ],
)
def test_common_cloud_gpus_are_known_by_the_names_nvml_reports(spelling, figures):
    gpu = build_catalog().get(spelling)
    assert (gpu.name, gpu.tflops_bf16, gpu.hbm_gb, gpu.hbm_tb_per_s, gpu.link_gb_per_s) == figures


def test_neighbouring_names_stay_apart():
    catalog = build_catalog()
    assert catalog.get("L40").name == "L40" and catalog.get("L40S").name == "L40S"
    assert catalog.get("A100").name == "A100-80GB" and catalog.get("H100").name == "H100"


def test_a_recipe_figure_is_cited_as_the_recipe():
    gpu = build_catalog({"L4": {"hbm_tb_per_s": 0.25}}).get("L4")
    assert gpu.hbm_tb_per_s == 0.25 and gpu.source("hbm_tb_per_s") == "hex.gpu_catalog.L4"
    assert "datasheet" in gpu.source("tflops_bf16")


def test_catalog_command_lists_gpus_with_sources_and_models(capsys):
    assert main(["catalog", "--json", "-"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    jsonschema.validate(doc, load_schema("catalog"), cls=jsonschema.Draft202012Validator)
    assert {g["name"] for g in doc["gpus"]} == {g.name for g in BUILTIN_GPUS}
    assert {m["name"] for m in doc["models"]} == set(BUILTIN_MODELS)
    text = captured.err  # the tables, since stdout carries the JSON
    for gpu in BUILTIN_GPUS:
        assert f"\n{gpu.name} " in text and f"  {gpu.name}: " in text  # a row and its sources
    assert "Qwen2.5-7B" in text and "heads / KV" in text
