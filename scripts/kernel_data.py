"""Tabulate measured SGLang kernel data: one decode and one prefill iteration per GPU type, model, TP, batch, context.

The oracle is NVIDIA's aiconfigurator-core (per-op SGLang latencies collected on each system, composed into one
engine iteration on CPU). The planner never imports it: this script writes a compact table that
``areal_hex_plugin.costmodel.kernel_data`` interpolates, and a few off-grid oracle figures the tests check the
interpolation against. Run it in its own venv (aiconfigurator-core pulls pandas, pyarrow and scipy):

    python3 -m venv /tmp/aic && /tmp/aic/bin/pip install aiconfigurator-core==0.12.0
    PYTHONPATH=$PWD /tmp/aic/bin/python scripts/kernel_data.py            # about 5 minutes on 2 cores
    PYTHONPATH=$PWD /tmp/aic/bin/python scripts/kernel_data.py --checks   # only the test figures
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from areal_hex_plugin.costmodel.kernel_data import FORMAT, PHASES, TABLE, shape_key
from areal_hex_plugin.specs.models import BUILTIN_MODELS, ModelShape

CHECKS = Path(__file__).resolve().parents[1] / "tests" / "costmodel" / "data" / "kernel_data_oracle.json"
BACKEND = "sglang"
# Catalog name -> aiconfigurator system with collected SGLang data. Not covered: H800, H20, L20, RTX4090,
# A800 (the A100 die with a narrower NVLink), A100-40GB (slower HBM), H100-PCIe (no data shipped).
SYSTEMS = {
    "H100": "h100_sxm",
    "H200": "h200_sxm",
    "A100-80GB": "a100_sxm",
    "L40S": "l40s",
    "B200": "b200_sxm",
}
BATCH = [2**i for i in range(10)]  # 1 .. 512 sequences
CONTEXT = [2**i for i in range(7, 16)]  # 128 .. 32,768 tokens per sequence
TP = (1, 2, 4, 8)
# Off-grid points the tests compare the interpolation with (3 batch sizes x 2 contexts), per type and layout.
CHECK_BATCH = (3, 48, 384)
CHECK_CONTEXT = (700, 12_000)
CHECK_LAYOUTS = (("DeepSeek-R1-Distill-Qwen-7B", 1), ("DeepSeek-R1-Distill-Qwen-14B", 2))


def _architecture(shape: ModelShape) -> str:
    if shape.name.startswith("Qwen3"):
        return "Qwen3ForCausalLM"
    return "LlamaForCausalLM" if shape.name.startswith("Llama") else "Qwen2ForCausalLM"


def _config_dir(shape: ModelShape, root: Path) -> str:
    """A folder with the HF ``config.json`` aiconfigurator reads the shape from."""
    folder = root / shape.name
    folder.mkdir(exist_ok=True)
    config = {
        "architectures": [_architecture(shape)],
        "model_type": _architecture(shape).removesuffix("ForCausalLM").lower(),
        "num_hidden_layers": shape.layers,
        "hidden_size": shape.hidden,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.dim_per_head,
        "intermediate_size": shape.ffn,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied_embeddings,
        "max_position_embeddings": 131_072,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


class Oracle:
    """aiconfigurator-core's compiled engine for one system, model and TP (milliseconds per iteration)."""

    def __init__(self, system: str, model_dir: str, tp: int) -> None:
        from aiconfigurator_core.sdk.engine import EngineHandle

        self.handle = EngineHandle.compile(model_dir, system, BACKEND, tp_size=tp)

    def decode_ms(self, batch: int, context: int) -> float:
        # One decode step of ``batch`` sequences whose KV holds ``context`` tokens (s = isl + osl // 2 + 1).
        return self.handle.decode_step_latency(batch, context - 1, 1)

    def prefill_ms(self, batch: int, context: int) -> float:
        return self.handle.predict_prefill_latency(batch, context, 0)


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def envelope(grid: list[list[float]]) -> list[list[float]]:
    """The largest grid at or below ``grid`` that never falls as batch or context grows.

    The oracle's per-op data dips by up to 17% from one batch size to the next for small models (kernel choice
    per GEMM shape); SGLang pads a batch to the next captured CUDA-graph size anyway, and attention over fewer
    cached tokens is never slower, so a point may take the time of any larger one.
    """
    out = [row[:] for row in grid]
    for i in reversed(range(len(out))):
        for j in reversed(range(len(out[i]))):
            if i + 1 < len(out):
                out[i][j] = min(out[i][j], out[i + 1][j])
            if j + 1 < len(out[i]):
                out[i][j] = min(out[i][j], out[i][j + 1])
    return out


def _models() -> dict[str, ModelShape]:
    """The built-in dense models, one per shape (the table is keyed by shape, not name)."""
    out: dict[str, ModelShape] = {}
    for shape in BUILTIN_MODELS.values():
        out.setdefault(shape_key(shape), shape)
    return out


def _versions() -> dict[str, str]:
    from aiconfigurator_core.sdk.perf_database import get_latest_database_version

    return {name: get_latest_database_version(system=sys_, backend=BACKEND) for name, sys_ in SYSTEMS.items()}


def build_table(root: Path) -> dict:
    models: dict[str, dict] = {}
    lowered, cells, deepest = dict.fromkeys(PHASES, 0), dict.fromkeys(PHASES, 0), dict.fromkeys(PHASES, 0.0)
    for key, shape in _models().items():
        entry: dict = {"name": shape.name, "decode_ms": {}, "prefill_ms": {}}
        model_dir = _config_dir(shape, root)
        for gpu, system in SYSTEMS.items():
            for tp in TP:
                if shape.heads % tp:
                    continue  # SGLang splits attention heads evenly across TP ranks
                started = time.perf_counter()
                try:
                    oracle = Oracle(system, model_dir, tp)
                    raw = {
                        name: [[_round(fn(b, c)) for c in CONTEXT] for b in BATCH]
                        for name, fn in (("decode_ms", oracle.decode_ms), ("prefill_ms", oracle.prefill_ms))
                    }
                except (
                    RuntimeError,
                    ValueError,
                ) as exc:  # the oracle lacks a kernel (e.g. head_dim 64 on A100)
                    print(f"{shape.name} {gpu} tp{tp}: not covered: {str(exc)[:120]}", file=sys.stderr)
                    continue
                for name, grid in raw.items():
                    smooth = entry[name].setdefault(gpu, {})[str(tp)] = envelope(grid)
                    cuts = [
                        1 - smooth[i][j] / grid[i][j] for i in range(len(BATCH)) for j in range(len(CONTEXT))
                    ]
                    lowered[name] += sum(c > 0 for c in cuts)
                    cells[name] += len(cuts)
                    deepest[name] = max(deepest[name], *cuts)
                print(f"{shape.name} {gpu} tp{tp}: {time.perf_counter() - started:.2f} s", file=sys.stderr)
        if entry["decode_ms"]:
            models[key] = entry
    for name in PHASES:
        print(f"{name}: envelope lowered {lowered[name]} of {cells[name]} cells, by at most {deepest[name]:.1%}",
              file=sys.stderr)  # fmt: skip
    return {
        "format": FORMAT,
        "source": f"aiconfigurator-core {version('aiconfigurator-core')}, backend {BACKEND} (scripts/kernel_data.py)",
        "backend_versions": _versions(),
        "systems": SYSTEMS,
        "batch": BATCH,
        "context": CONTEXT,
        "models": models,
    }


def build_checks(root: Path) -> dict:
    points = []
    for name, tp in CHECK_LAYOUTS:
        shape = BUILTIN_MODELS[name]
        model_dir = _config_dir(shape, root)
        for gpu, system in SYSTEMS.items():
            oracle = Oracle(system, model_dir, tp)
            for b in CHECK_BATCH:
                for c in CHECK_CONTEXT:
                    points.append(
                        {"gpu": gpu, "model": name, "tp": tp, "batch": b, "context": c,
                         "decode_ms": oracle.decode_ms(b, c), "prefill_ms": oracle.prefill_ms(b, c)}
                    )  # fmt: skip
    return {"source": f"aiconfigurator-core {version('aiconfigurator-core')}", "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checks", action="store_true", help="write only the tests' oracle figures")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the oracle warns once per system about MLA fallback rows we never use
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        CHECKS.parent.mkdir(parents=True, exist_ok=True)
        CHECKS.write_text(json.dumps(build_checks(root), indent=1) + "\n")
        if not args.checks:
            TABLE.write_text(json.dumps(build_table(root), separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
