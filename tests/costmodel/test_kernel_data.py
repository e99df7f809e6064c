"""Measured kernel data (aiconfigurator-core's SGLang iteration estimates): the shipped table, its checks on entry,
its interpolation against the oracle's own off-grid figures, and None wherever it has no data."""

from __future__ import annotations

import importlib.util
import json
from importlib.metadata import PackageNotFoundError, version

import pytest

from areal_hex_plugin.costmodel.kernel_data import (
    TABLE,
    decode_iteration_s,
    load_table,
    prefill_s,
    shape_key,
)
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.models import BUILTIN_MODELS, resolve_model
from tests.conftest import REPO

ORACLE = json.loads((REPO / "tests" / "costmodel" / "data" / "kernel_data_oracle.json").read_text())
COVERED = {"H100", "H200", "A100-80GB", "L40S", "B200"}
RECIPE_MODELS = (
    "DeepSeek-R1-Distill-Qwen-1.5B",
    "DeepSeek-R1-Distill-Qwen-7B",
    "DeepSeek-R1-Distill-Qwen-14B",
    "Qwen2.5-7B",
    "Qwen3-4B",
    "Llama-3.1-8B",
)
SEVEN_B = BUILTIN_MODELS["DeepSeek-R1-Distill-Qwen-7B"]
KEY = shape_key(SEVEN_B)


def _aiconfigurator() -> str | None:
    try:
        return version("aiconfigurator-core")
    except PackageNotFoundError:
        return None


def test_table_covers_the_measured_types_and_the_recipes_models():
    table = load_table()
    assert set(table.systems) == COVERED
    assert "aiconfigurator-core 0.12.0" in table.source and ORACLE["source"] in table.source
    for name in RECIPE_MODELS:
        for gpu in COVERED:
            assert decode_iteration_s(gpu, BUILTIN_MODELS[name], 1, 64, 2048) is not None, (name, gpu)
            assert prefill_s(gpu, BUILTIN_MODELS[name], 1, 8, 1024) is not None, (name, gpu)


@pytest.mark.parametrize("phase, lookup", [("decode_ms", decode_iteration_s), ("prefill_ms", prefill_s)])
def test_interpolation_within_10_percent_of_the_oracle_off_grid(phase, lookup):
    points = ORACLE["points"]
    assert {p["gpu"] for p in points} == COVERED
    assert {(p["batch"], p["context"]) for p in points if p["gpu"] == "H100"} == {
        (b, c) for b in (3, 48, 384) for c in (700, 12_000)
    }
    for p in points:
        got = lookup(p["gpu"], BUILTIN_MODELS[p["model"]], p["tp"], p["batch"], p["context"])
        assert got * 1000 == pytest.approx(p[phase], rel=0.10), p


def test_reproduces_the_cli_static_gen_tpot():
    """`aiconfigurator cli estimate --system h100_sxm --backend sglang --estimate-mode static_gen --isl 512
    --osl 2400 --tp-size 1` on a Qwen2-7B config printed TPOT 5.95 / 8.49 / 16.06 ms at batch 1 / 64 / 256: the
    mean of the table's decode iterations over the same contexts (every 32nd step, as the CLI samples them)."""
    for batch, tpot_ms in ((1, 5.954), (64, 8.491), (256, 16.058)):
        steps = [decode_iteration_s("H100", SEVEN_B, 1, batch, 513 + i) for i in range(0, 2400, 32)]
        assert sum(steps) / len(steps) * 1000 == pytest.approx(tpot_ms, rel=0.02)


@pytest.mark.parametrize("gpu", sorted(COVERED))
def test_decode_rises_with_batch_and_context(gpu):
    table = load_table()
    batches = [round(2**x) for x in (0, 1.5, 3, 4.5, 6, 7.5, 9)]
    contexts = [round(2**x) for x in (7, 8.5, 10, 11.5, 13, 14.5, 15)]
    for name in RECIPE_MODELS:
        grid = [[decode_iteration_s(gpu, BUILTIN_MODELS[name], 1, b, c) for c in contexts] for b in batches]
        for batch, row in zip(batches, grid, strict=True):
            assert row == sorted(row) and row[-1] > row[0], (name, row)
            if batch >= 64:  # 64 sequences x 32k tokens of KV outweigh the weights many times over
                assert row[-1] > 2 * row[0], (name, row)
        for low, high in zip(grid, grid[1:], strict=False):
            assert all(h >= lo for lo, h in zip(low, high, strict=True)), name
        assert grid[-1][0] > 1.5 * grid[0][0], name  # 512 sequences against 1
    for (phase, _, _, _), rows in table.grids.items():
        flat = [v for row in rows for v in row]
        assert rows[-1][-1] == max(flat) and rows[0][0] == min(flat) and max(flat) > min(flat), phase


def test_more_tp_is_faster_and_h200_beats_h100_on_long_contexts():
    fourteen = BUILTIN_MODELS["DeepSeek-R1-Distill-Qwen-14B"]
    per_tp = [decode_iteration_s("H100", fourteen, tp, 64, 4096) for tp in (1, 2, 4, 8)]
    assert per_tp == sorted(per_tp, reverse=True)
    assert decode_iteration_s("H200", SEVEN_B, 1, 128, 16_384) < decode_iteration_s(
        "H100", SEVEN_B, 1, 128, 16_384
    )


def test_none_where_not_covered():
    for gpu in ("H800", "H20", "RTX4090", "L20", "A800", "A100-40GB", "H100-PCIe", "no such GPU"):
        assert decode_iteration_s(gpu, SEVEN_B, 1, 64, 2048) is None, gpu
        assert prefill_s(gpu, SEVEN_B, 1, 8, 1024) is None, gpu
    tiny = resolve_model(str(REPO / "recipes" / "ci" / "tiny-qwen2"), "model")
    assert decode_iteration_s("H100", tiny, 1, 64, 2048) is None  # a shape the table lacks
    assert decode_iteration_s("H100", SEVEN_B, 8, 64, 2048) is None  # 28 heads do not split 8 ways
    assert decode_iteration_s("A100-80GB", BUILTIN_MODELS["Llama-3.2-1B"], 1, 8, 1024) is None  # head_dim 64
    for batch, context in ((0.5, 2048), (513, 2048), (64, 127), (64, 32_769), (0, 0)):
        assert decode_iteration_s("H100", SEVEN_B, 1, batch, context) is None, (batch, context)
    assert decode_iteration_s("H100", SEVEN_B, 1, 512, 32_768) is not None  # the grid's corners are in


def test_aliases_and_shape_twins_share_the_data():
    assert decode_iteration_s("A100", SEVEN_B, 1, 64, 2048) == decode_iteration_s(
        "A100-80GB", SEVEN_B, 1, 64, 2048
    )
    assert decode_iteration_s("H100-SXM", SEVEN_B, 1, 64, 2048) == decode_iteration_s(
        "H100", SEVEN_B, 1, 64, 2048
    )
    # Qwen2.5-7B has the distilled model's shape: the table is keyed by shape, not name.
    assert shape_key(BUILTIN_MODELS["Qwen2.5-7B"]) == shape_key(SEVEN_B)


def _broken(tmp_path, change) -> str:
    """The shipped table cut to one model (quick to read), with ``change`` made to it."""
    data = json.loads(TABLE.read_text())
    data["models"] = {KEY: data["models"][KEY]}
    change(data)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda d: d.update(format="areal-hex-profile/1"), "is not a kernel-data table"),
        (lambda d: d.update(source=""), "must name the tool"),
        (lambda d: d.update(batch=[1, 4, 2]), "must be a rising list"),
        (lambda d: d["models"][KEY]["decode_ms"]["H100"]["1"].pop(), "must be 10 rows"),
        (lambda d: d["models"][KEY]["decode_ms"]["H100"]["1"][0].pop(), "each row must hold 9"),
        (lambda d: d["models"][KEY]["prefill_ms"]["H100"]["1"][3].__setitem__(2, -1.0), "positive number"),
        (lambda d: d["models"][KEY]["decode_ms"]["H100"]["1"][3].__setitem__(2, 1e-3), "must not fall"),
        (lambda d: d["models"][KEY]["decode_ms"]["H100"]["1"][9].__setitem__(0, 1e-3), "must not fall"),
        (lambda d: d["models"][KEY]["decode_ms"].update(H800={}), "listed under systems"),
        (lambda d: d["models"][KEY]["decode_ms"]["H100"].update(x=[]), "TP must be a whole number"),
        (lambda d: d["models"][KEY].pop("prefill_ms"), "must map GPU types to TP degrees"),
    ],
)
def test_a_broken_table_is_refused_where_it_enters(tmp_path, change, problem):
    path = _broken(tmp_path, change)
    with pytest.raises(HexError, match=problem) as err:
        load_table(path)
    assert str(path) in err.value.field and "scripts/kernel_data.py" in err.value.fix


@pytest.mark.skipif(
    _aiconfigurator() is None, reason="aiconfigurator-core is not installed (see scripts/kernel_data.py)"
)
def test_stored_oracle_figures_match_a_live_oracle(tmp_path):
    if _aiconfigurator() not in ORACLE["source"]:
        pytest.skip(
            f"installed aiconfigurator-core {_aiconfigurator()} differs from the stored {ORACLE['source']}"
        )
    spec = importlib.util.spec_from_file_location("kernel_data_script", REPO / "scripts" / "kernel_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.build_checks(tmp_path) == ORACLE
