"""Each GPU type's ``hbm_fraction`` beside the KV rate InferSim's measured decode-attention kernels reach
(``costmodel/kernel_checks.py``): the rate recovered from the rows, the shipped data as measured, the check of the
paper calibration, and a bad kernel file refused with the place named."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from areal_hex_plugin.costmodel.calibration import BUILTIN, Calibration
from areal_hex_plugin.costmodel.kernel_checks import (
    ATTENTION,
    FORMAT,
    AttentionKernel,
    AttentionTable,
    attention_checks,
    load_attention,
)
from areal_hex_plugin.errors import HexError
from tests.conftest import REPO
from tests.costmodel.helpers import recipe


def _kernel(rate: float, launch_s: float = 20e-6) -> AttentionKernel:
    rows = []
    for batch in (1, 16, 64):
        for kv_len in (1024, 8192, 32768):
            kv = batch * kv_len * 2 * 4 * 128 * 2  # K and V, 4 KV heads of 128, bf16
            rows.append((batch, kv_len, launch_s + kv / rate))
    return AttentionKernel("H20", 32, 4, 128, tuple(rows))


def test_the_rate_is_the_slope_above_a_fixed_launch_cost():
    # 2 TB/s on the H20's 4.0 TB/s: half its HBM figure, whatever the launch cost.
    for launch in (0.0, 20e-6, 100e-6):
        assert _kernel(2e12, launch).streaming_rate() == pytest.approx(2e12, rel=1e-9)
    table = AttentionTable("hand-made", (_kernel(2e12),))
    (check,) = attention_checks(
        Calibration().with_factors("H20", {"hbm_fraction": 0.4}, "a test"), table=table
    )
    assert check["kernels"] == {"32q/4kv x 128": 0.5}
    assert check["kernel_fraction"] == 0.5 and check["hbm_fraction"] == 0.4 and check["ratio"] == 1.25
    assert check["hbm_fraction_source"] == "a test"


def test_the_shipped_kernels_stream_kv_as_their_large_rows_show():
    """The slope's rate against an independent figure: the median of KV bytes over seconds among the rows long
    enough (>= 200 us) that the launch cost is a small part."""
    table = load_attention()
    assert "InferSim" in table.source and "Apache-2.0" in table.source
    hbm = {"H20": 4.0e12, "H800": 3.35e12}  # the catalog's figures (NVIDIA's briefs)
    seen = set()
    for k in table.kernels:
        large = [k.kv_bytes(b, n) / s for b, n, s in k.rows if s >= 200e-6]
        assert len(large) >= 5, k.layout
        assert k.streaming_rate() == pytest.approx(statistics.median(large), rel=0.05), (k.gpu_type, k.layout)
        fraction = k.streaming_rate() / hbm[k.gpu_type]
        assert (0.6 < fraction < 0.85) if k.gpu_type == "H20" else (0.9 < fraction < 0.97), (
            k.layout,
            fraction,
        )
        seen.add((k.gpu_type, k.kv_heads))
    # The paper models' KV layouts at TP 1 (1.5B: 2 KV heads, 7B: 4, 14B: 8) on both types.
    assert {(t, kv) for t in hbm for kv in (2, 4, 8)} <= seen


def test_the_paper_calibration_reads_h20_kv_at_half_the_kernels_rate():
    checks = {c["gpu_type"]: c for c in attention_checks(recipe("paper/7b.yaml").calibration)}
    h20, h800 = checks["H20"], checks["H800"]
    assert h20["hbm_fraction"] == 0.4 and h20["hbm_fraction_source"].startswith("fit to baselines.json")
    assert h20["kernel_fraction"] == pytest.approx(0.75, abs=0.01)
    assert h20["ratio"] == pytest.approx(h20["kernel_fraction"] / 0.4, rel=1e-3)
    assert h800["hbm_fraction_source"].startswith("assumed default") and h800["ratio"] > 1.15
    assert "H800-PCIe" not in checks  # no kernel data for the PCIe part
    # calibrate records the check of each type it writes (H20 and H800-PCIe here: the PCIe part has no kernels).
    shipped = json.loads((BUILTIN / "paper.json").read_text())["kernel_checks"]
    assert shipped == [h20]


@pytest.mark.parametrize(
    ("edit", "where", "words"),
    [
        (lambda d: d.update(format="other"), "infersim.json", "is not a decode-attention kernel file"),
        (lambda d: d.update(source=""), "infersim.json: source", "license"),
        (lambda d: d["kernels"][0].update(kv_heads=0), "kernels[0].kv_heads", "whole number"),
        (lambda d: d["kernels"][1].update(rows=[[1, 1024, 30.0]]), "kernels[1].rows", "at least 2 rows"),
        (lambda d: d["kernels"][0]["rows"][3].__setitem__(2, -1), "kernels[0].rows[3]", "microseconds > 0"),
        (
            lambda d: d["kernels"][0].update(rows=[[1, 1024, 90.0], [16, 8192, 30.0]]),
            "kernels[0].rows",
            "the seconds fall as KV grows",
        ),
    ],
)
def test_a_bad_kernel_file_is_refused_naming_the_place(tmp_path, edit, where, words):
    data = json.loads(ATTENTION.read_text())
    assert data["format"] == FORMAT
    edit(data)
    path = tmp_path / "infersim.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HexError) as err:
        load_attention(path)
    assert where in err.value.field and words in str(err.value)
    assert "scripts/infersim_kernels.py" in str(err.value)


def test_the_script_copies_infersims_kv_streaming_layouts(tmp_path):
    """``scripts/infersim_kernels.py`` on a checkout shaped like InferSim's: the bf16 rows of the layouts that
    stream KV, the commit named in the source; a wide group (compute-bound on H20) and fp8 rows left out."""
    root = tmp_path / "infersim"
    folder = root / "bench_data" / "mha" / "decode" / "h20"
    folder.mkdir(parents=True)
    header = "dtype,kv_dtype,batch_size,kv_len,latency_us,mfu\n"
    (folder / "32-4-128.csv").write_text(
        header + "bf16,bf16,1,1024,30.0,0.001\nbf16,bf16,16,8192,100.4,0.1\nfp8,fp8,16,8192,60.0,0.1\n"
    )
    (folder / "128-2-128.csv").write_text(
        header + "bf16,bf16,1,1024,30.0,0.001\nbf16,bf16,16,8192,90.0,0.1\n"
    )
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "data"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    out = tmp_path / "kernels.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "infersim_kernels.py"), str(root), "--out", str(out)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = load_attention(out)
    assert commit[:12] in table.source and "Apache-2.0" in table.source
    (kernel,) = table.kernels
    assert (kernel.gpu_type, kernel.layout) == ("H20", "32q/4kv x 128")
    assert kernel.rows == ((1, 1024, 30.0e-6), (16, 8192, 100.4e-6))
