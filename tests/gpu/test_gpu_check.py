"""scripts/gpu_check.py without a GPU: it refuses in one line (exit 2); its predictions, grid and report; and its
torch side (the decoder's iteration over a static KV cache, the timed training step) on CPU with a tiny shape."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys

import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.models import ModelShape
from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(gpu_check)
TINY = ModelShape("tiny", 2, 64, 4, 2, 128, 100, False, qkv_bias=True)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_it_refuses_in_one_line_with_exit_2():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd="/", timeout=120)
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--dry-run" in lines[0]
    assert "Traceback" not in proc.stderr


def test_dry_run_prints_every_prediction_as_json_lines_and_a_table(capsys):
    assert gpu_check.main(["--dry-run", "--gpu-type", "H100"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    grid = gpu_check.decode_grid()
    assert len(records) == len(grid) + 3
    assert [(r["batch"], r["context"]) for r in records if r["kind"] == "decode"] == grid
    assert all(r["gpu_type"] == "H100" and r["predicted_s"] > 0 and r["measured_s"] is None for r in records)
    assert "measured/model" in out and "train_optimizer" in out


def test_dry_run_needs_a_gpu_type_without_a_gpu(capsys):
    if _cuda():
        pytest.skip("this machine has a GPU: its type is detected")
    assert gpu_check.main(["--dry-run"]) == 2
    assert "--gpu-type" in capsys.readouterr().out


def test_an_unknown_gpu_type_is_refused_naming_the_flag(capsys):
    assert gpu_check.main(["--dry-run", "--gpu-type", "Z9000"]) == 2
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "--gpu-type" in out and "Z9000" in out


@pytest.mark.parametrize(
    ("device", "gpu_type"),
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H20", "H20"), ("NVIDIA H800 PCIe", "H800-PCIe"),
     ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA H200", "H200")],
)  # fmt: skip
def test_device_names_map_to_catalog_types(device, gpu_type):
    assert gpu_check.gpu_type_of(device) == gpu_type


def test_an_unknown_device_is_a_hex_error():
    with pytest.raises(HexError, match="not in the GPU catalog"):
        gpu_check.gpu_type_of("NVIDIA Z9000")


def test_predictions_come_from_the_cost_model():
    cal = gpu_check.calibration("builtin:paper")
    # H100: NVIDIA's measured SGLang kernel data; H800-PCIe: the roofline with the paper's fitted factors.
    assert gpu_check.predict_decode("H100", cal, 32, 4096)[1] == "kernel data"
    assert gpu_check.predict_decode("H800-PCIe", cal, 32, 4096)[1] == "roofline"
    small, _ = gpu_check.predict_decode("H100", cal, 8, 1024)
    large, _ = gpu_check.predict_decode("H100", cal, 256, 16384)
    assert 0 < small < large
    train = gpu_check.predict_train("H100", cal, 4, 2048)
    assert train["step"] == pytest.approx(train["fwd_bwd"] + train["optimizer"])
    assert gpu_check.predict_train("H100", cal, 4, 2048, checkpointing=True)["fwd_bwd"] > train["fwd_bwd"]


def test_the_grid_runs_the_smallest_caches_first_and_the_largest_do_not_fit_one_h100():
    grid = gpu_check.decode_grid()
    sizes = [gpu_check.kv_cache_gb(gpu_check.DECODE_MODEL, b, c) for b, c in grid]
    assert sizes == sorted(sizes)
    assert sizes[-1] > 80 > sizes[0]  # the check skips what does not fit, and says so


def test_the_report_shows_the_ratio_of_measured_to_predicted():
    row = gpu_check.Row(
        "decode", "m", 8, 1024, predicted_s=0.010, source="roofline", measured_s=0.012, note="x"
    )
    out = io.StringIO()
    gpu_check.report([row], "H20", "NVIDIA H20", out)
    record = json.loads(out.getvalue().splitlines()[0])
    assert record["ratio"] == pytest.approx(1.2) and record["device"] == "NVIDIA H20"
    assert "1.20" in out.getvalue() and "12.000" in out.getvalue()


def test_the_decoder_writes_the_new_token_into_the_last_cache_slot_and_reads_the_whole_cache():
    torch = pytest.importorskip("torch")
    decoder = gpu_check.Decoder(TINY, "cpu", torch.float32)
    kv = decoder.cache(3, 16)
    tokens = torch.tensor([1, 2, 3])
    first = decoder.step(tokens, kv)
    assert first.shape == (3,) and int(first.max()) < TINY.vocab
    assert kv[:, :, :, :, -1].abs().sum() > 0 and kv[:, :, :, :, :-1].abs().sum() == 0
    kv[:, 1, :, :, 0] = (
        torch.randn_like(kv[:, 1, :, :, 0]) * 1000
    )  # the first token's values change the output
    assert not torch.equal(decoder.step(tokens, kv), first)
    seconds, mode = gpu_check.time_decode(decoder, 2, 8, target_s=0.01)
    assert seconds > 0 and mode == "eager"


def test_the_training_step_times_forward_backward_and_the_optimizer_and_updates_the_weights():
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    net = gpu_check.train_model(TINY, "cpu")
    before = [p.detach().clone() for p in net.parameters()]
    seconds = gpu_check.time_train(net, 2, 16, "cpu", steps=1)
    assert seconds["fwd_bwd"] > 0 and seconds["optimizer"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
