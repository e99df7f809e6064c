"""Measured kernel data: seconds of one SGLang decode or prefill iteration, from a table of NVIDIA's aiconfigurator.

``profiles/kernels/sglang.json`` holds aiconfigurator-core's estimate of one engine iteration, composed from per-op
SGLang latencies collected on each covered system, on a grid of batch (sequences) x context (tokens per sequence)
for each built-in model shape and TP degree. Lookups interpolate log-log in batch and context and return None
outside the grid, for a GPU type without collected data (H800, H20, L20, RTX4090, ...) and for a model shape or
TP the table lacks: the caller then uses its roofline. ``scripts/kernel_data.py`` regenerates the table.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.catalog import BUILTIN_GPUS, GpuCatalog
from areal_hex_plugin.specs.files import read_format
from areal_hex_plugin.specs.models import ModelShape

TABLE = Path(__file__).resolve().parent / "profiles" / "kernels" / "sglang.json"
FORMAT = "areal-hex-kernel-data/1"
PHASES = ("decode_ms", "prefill_ms")
_FIX = "regenerate it with scripts/kernel_data.py (see its docstring)"

Grid = tuple[tuple[float, ...], ...]  # log(milliseconds), [batch][context]


def shape_key(model: ModelShape) -> str:
    """What the latency depends on: layers, widths, heads and vocabulary (not the name, tying or biases)."""
    m = model
    return f"{m.layers}L-{m.hidden}h-{m.heads}q{m.kv_heads}kv{m.dim_per_head}d-{m.ffn}f-{m.vocab}v"


@dataclass(frozen=True)
class KernelTable:
    source: str
    systems: dict[str, str]  # catalog GPU name -> aiconfigurator system
    log_batch: tuple[float, ...]
    log_context: tuple[float, ...]
    grids: dict[tuple[str, str, str, int], Grid]  # (phase, shape key, GPU, TP) -> grid


def _axis(data: dict, name: str, where: str) -> tuple[float, ...]:
    values = data.get(name)
    if (
        not isinstance(values, list)
        or len(values) < 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
        or any(a >= b for a, b in zip(values, values[1:], strict=False))
    ):
        raise HexError(f"{where}: {name}", "must be a rising list of at least 2 whole numbers >= 1", _FIX)
    return tuple(math.log(v) for v in values)


def _grid(rows: object, shape: tuple[int, int], where: str) -> Grid:
    if not isinstance(rows, list) or len(rows) != shape[0]:
        raise HexError(where, f"must be {shape[0]} rows (one per batch size)", _FIX)
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != shape[1]:
            raise HexError(where, f"each row must hold {shape[1]} figures (one per context)", _FIX)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf for v in row):
            raise HexError(where, "each figure must be a positive number of milliseconds", _FIX)
        out.append(tuple(math.log(v) for v in row))
    rising = all(a <= b for row in out for a, b in zip(row, row[1:], strict=False)) and all(
        a <= b for low, high in zip(out, out[1:], strict=False) for a, b in zip(low, high, strict=True)
    )
    if not rising:
        raise HexError(where, "must not fall as batch or context grows", _FIX)
    return tuple(out)


@cache
def load_table(path: Path = TABLE) -> KernelTable:
    """The table at ``path``, checked whole: every problem is a :class:`HexError` naming where it is."""
    where = str(path)
    data = read_format(path, FORMAT, where, "a kernel-data table", _FIX)
    systems, models, source = data.get("systems"), data.get("models"), data.get("source")
    if not isinstance(source, str) or not source:
        raise HexError(f"{where}: source", "must name the tool and version that measured the table", _FIX)
    if not isinstance(systems, dict) or not all(isinstance(v, str) for v in systems.values()):
        raise HexError(f"{where}: systems", "must map GPU type names to aiconfigurator systems", _FIX)
    if not isinstance(models, dict):
        raise HexError(f"{where}: models", "must map model shapes to their grids", _FIX)
    log_batch, log_context = _axis(data, "batch", where), _axis(data, "context", where)
    shape = (len(log_batch), len(log_context))
    grids = {}
    for key, entry in models.items():
        for phase in PHASES:
            per_gpu = entry.get(phase) if isinstance(entry, dict) else None
            if not isinstance(per_gpu, dict):
                raise HexError(f"{where}: models.{key}.{phase}", "must map GPU types to TP degrees", _FIX)
            for gpu, per_tp in per_gpu.items():
                at = f"{where}: models.{key}.{phase}.{gpu}"
                if gpu not in systems or not isinstance(per_tp, dict):
                    raise HexError(at, "must be a GPU type listed under systems, mapping TP to a grid", _FIX)
                for tp, rows in per_tp.items():
                    if not tp.isdigit() or int(tp) < 1:
                        raise HexError(f"{at}.{tp}", "TP must be a whole number >= 1", _FIX)
                    grids[(phase, key, gpu, int(tp))] = _grid(rows, shape, f"{at}.{tp}")
    return KernelTable(source, dict(systems), log_batch, log_context, grids)


_CATALOG = GpuCatalog({spec.name: spec for spec in BUILTIN_GPUS})


@lru_cache(maxsize=4096)
def _find(phase: str, gpu_type: str, model: ModelShape, tp: int) -> Grid | None:
    return load_table().grids.get((phase, shape_key(model), _CATALOG.canonical(gpu_type) or "", tp))


def _interpolate(table: KernelTable, grid: Grid, batch: float, context: float) -> float | None:
    """Bilinear interpolation of log(ms) over (log batch, log context); None outside the grid."""
    if batch <= 0 or context <= 0:
        return None
    x, y = math.log(batch), math.log(context)
    xs, ys = table.log_batch, table.log_context
    if not (xs[0] <= x <= xs[-1] and ys[0] <= y <= ys[-1]):
        return None
    i = min(bisect_right(xs, x), len(xs) - 1) - 1
    j = min(bisect_right(ys, y), len(ys) - 1) - 1
    u = (x - xs[i]) / (xs[i + 1] - xs[i])
    v = (y - ys[j]) / (ys[j + 1] - ys[j])
    low = grid[i][j] + (grid[i][j + 1] - grid[i][j]) * v
    high = grid[i + 1][j] + (grid[i + 1][j + 1] - grid[i + 1][j]) * v
    return math.exp(low + (high - low) * u) / 1000.0


def decode_iteration_s(
    gpu_type: str, model: ModelShape, tp: int, batch: float, context: float
) -> float | None:
    """Seconds of one decode iteration of ``batch`` sequences at a mean ``context`` (tokens in the KV cache per
    sequence) on one TP group of ``gpu_type``; None where the table does not cover it."""
    grid = _find("decode_ms", gpu_type, model, tp)
    return None if grid is None else _interpolate(load_table(), grid, batch, context)


def prefill_s(gpu_type: str, model: ModelShape, tp: int, batch: float, context: float) -> float | None:
    """Seconds to prefill ``batch`` sequences of ``context`` new tokens each (no cached prefix) on one TP group of
    ``gpu_type``; None where the table does not cover it."""
    grid = _find("prefill_ms", gpu_type, model, tp)
    return None if grid is None else _interpolate(load_table(), grid, batch, context)
