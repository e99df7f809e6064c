"""GPU check for ``areal-hex profile``: real kernels on the local CUDA GPU give sane efficiency factors.

.venv/bin/pytest -m gpu tests/gpu/profile_check.py        (skipped without CUDA)
.venv/bin/python tests/gpu/profile_check.py OUT.json      (prints and writes the measured profile)
"""

from __future__ import annotations

import json
import sys

import pytest

from areal_hex_plugin.areal.profiler import measure
from areal_hex_plugin.cli import main
from areal_hex_plugin.commands.profile import derive_factors
from areal_hex_plugin.costmodel.calibration import read_profile
from areal_hex_plugin.specs.catalog import build_catalog
from areal_hex_plugin.specs.models import resolve_model

pytestmark = pytest.mark.gpu
MODEL = "Qwen2.5-1.5B"


def _gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    catalog = build_catalog()
    if name not in catalog:
        pytest.skip(f"{name} is not in the GPU catalog")
    return catalog.get(name)


def test_measured_factors_are_physical():
    gpu = _gpu()
    raw = measure(resolve_model(MODEL, "model"), (1, 64, 256), context=2048, train_tokens=8192)
    factors = derive_factors(raw, gpu.hbm_tb_per_s, gpu.tflops_bf16)
    assert all(0 < v <= 1 for v in factors.values())
    # A real GPU streams weights at a good share of HBM and keeps its tensor cores busy at batch 256.
    assert factors["hbm_fraction"] > 0.4
    assert factors["infer_mfu"] > 0.2 and factors["train_mfu"] > 0.1
    decode = raw["decode"]
    rates = [d["dense_flops"] / d["dense_s"] for d in decode]
    assert rates == sorted(rates)  # batching raises achieved FLOPS
    assert decode[0]["weight_bytes"] / decode[0]["dense_s"] > 0.3 * gpu.hbm_bytes_per_s  # batch 1: HBM-bound


def test_profile_command_writes_a_readable_profile(tmp_path):
    gpu = _gpu()
    out = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--gpu-type",
                gpu.name,
                "--model",
                MODEL,
                "--batch-sizes",
                "1,128",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert set(read_profile(out)[gpu.name]) >= {"hbm_fraction", "infer_mfu", "train_mfu"}


if __name__ == "__main__":
    gpu = _gpu()
    raw = measure(resolve_model(MODEL, "model"), (1, 16, 64, 256), context=2048, train_tokens=8192)
    report = {"gpu": gpu.name, "factors": derive_factors(raw, gpu.hbm_tb_per_s, gpu.tflops_bf16), "raw": raw}
    text = json.dumps(report, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            handle.write(text + "\n")
