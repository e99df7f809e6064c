"""GPU check for ``areal-hex profile``: a real SGLang engine and a real FSDP step on the local CUDA GPU.

The model has the paper 1.5B recipe's shape with random weights (nothing is downloaded), written to a temporary
folder that the recipe's ``actor.path`` then points at.

.venv/bin/pytest -m gpu tests/gpu/profile_check.py        (skipped without CUDA or a catalogued GPU; fails without
                                                          sglang)
.venv/bin/python tests/gpu/profile_check.py OUT.json      (runs it and keeps the profile at OUT.json)
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import pytest

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel.calibration import read_profile
from areal_hex_plugin.specs.catalog import build_catalog
from areal_hex_plugin.specs.recipe import load_recipe

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/paper/1.5b.yaml"


def local_gpu_type() -> str:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("sglang") is None:
        pytest.fail("failed: sglang not installed (bash scripts/setup.sh --gpu)", pytrace=False)
    name = torch.cuda.get_device_name()
    catalog = build_catalog()
    if name not in catalog:
        pytest.skip(f"{name} is not in the GPU catalog")
    return catalog.get(name).name


def random_model(folder: Path) -> Path:
    """The recipe's model shape with random bf16 weights, saved as an HF model folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = load_recipe(RECIPE, []).workload.model
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=shape.tied_embeddings,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def profile(gpu_type: str, model_dir: Path, out: Path) -> dict:
    argv = [
        "profile", str(RECIPE), f"actor.path={model_dir}", f"cluster.fileroot={out.parent / 'fileroot'}",
        "--gpu-type", gpu_type, "--batch-sizes", "1,8,32,128", "--prompt-tokens", "1024",
        "--decode-tokens", "128", "--train-gpus", "1", "--train-sequences", "8",
        "--train-sequence-tokens", "2048", "--json", str(out),
    ]  # fmt: skip
    if importlib.util.find_spec("flash_attn") is None:
        argv.insert(3, "++actor.attn_impl=sdpa")  # the trainer's default attention needs flash-attn
    assert main(argv) == 0
    return json.loads(out.read_text())


def check(document: dict, gpu_type: str) -> None:
    factors = document["gpu_types"][gpu_type]
    assert set(factors) >= {"hbm_fraction", "infer_mfu", "train_mfu"}
    assert all(0 < v <= 1 for v in factors.values()), factors
    # Floors that only a broken set-up misses (an engine off the GPU, eager kernels, a stalled trainer). A
    # small model's decode steps are partly fixed engine cost, which the fit books as lower HBM efficiency.
    assert factors["hbm_fraction"] > 0.15, factors
    assert factors["infer_mfu"] > 0.1, factors
    assert factors["train_mfu"] > 0.05, factors
    # The fitted model tracks the measured times within ~40% on average.
    assert document["fit"][gpu_type]["rms_log_error"] < 0.35, document["fit"]
    points = document["measurements"][gpu_type]["decode"]["points"]
    rates = [p["batch"] / p["step_s"] for p in points]
    assert rates == sorted(rates), "decode throughput must grow with the batch"


def test_profile_measures_and_fits_the_local_gpu(tmp_path):
    gpu_type = local_gpu_type()
    document = profile(gpu_type, random_model(tmp_path / "model"), tmp_path / "profile.json")
    check(document, gpu_type)
    assert read_profile(tmp_path / "profile.json")[gpu_type] == document["gpu_types"][gpu_type]


if __name__ == "__main__":
    gpu_type = local_gpu_type()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp) / "profile.json"
        document = profile(gpu_type, random_model(Path(tmp) / "model"), out)
    check(document, gpu_type)
    print(json.dumps({"gpu_type": gpu_type, "factors": document["gpu_types"][gpu_type],
                      "fit": document["fit"][gpu_type]}, indent=2))  # fmt: skip
