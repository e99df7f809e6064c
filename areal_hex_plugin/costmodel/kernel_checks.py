"""Each GPU type's ``hbm_fraction`` beside the rate measured decode kernels stream KV at: a check outside the model.

``profiles/kernels/infersim_attention.json`` (``scripts/infersim_kernels.py``) holds the FlashInfer decode-attention
latencies alibaba/InferSim measured on H20 and H800 (SXM) GPUs: one layer, bf16 KV, batch x KV length. Such a
kernel reads every sequence's KV once, so its seconds rise with the KV bytes at the rate HBM streams them, above a
fixed launch cost: the least-squares slope of seconds over bytes gives that rate, and the rate over the catalog's
HBM figure is the fraction of it the kernel reaches. The cost model reads KV and weights at ``hbm_fraction`` of
that figure (``costmodel/decode.py``). Nothing is fitted to the kernels: a fitted ``hbm_fraction`` far below
theirs says the fitted runs spend the difference outside the attention kernels (or that the fit is off), which
``areal-hex calibrate`` prints for its reader to weigh.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.catalog import build_catalog
from areal_hex_plugin.specs.files import read_format

ATTENTION = Path(__file__).resolve().parent / "profiles" / "kernels" / "infersim_attention.json"
FORMAT = "areal-hex-attention-kernels/1"
# Query heads per KV head up to which decode attention streams KV; wider groups are compute-bound on H20.
MAX_GROUP = 8
_FIX = "regenerate it with scripts/infersim_kernels.py (see its docstring)"


@dataclass(frozen=True)
class AttentionKernel:
    """One measured decode-attention layout: per row a batch, a KV length (tokens per sequence) and seconds."""

    gpu_type: str
    q_heads: int
    kv_heads: int
    head_dim: int
    rows: tuple[tuple[int, int, float], ...]

    @property
    def layout(self) -> str:
        return f"{self.q_heads}q/{self.kv_heads}kv x {self.head_dim}"

    def kv_bytes(self, batch: int, kv_len: int) -> int:
        """K and V of ``batch`` sequences of ``kv_len`` tokens, bf16."""
        return batch * kv_len * 2 * self.kv_heads * self.head_dim * 2

    def streaming_rate(self) -> float:
        """Bytes per second: the least-squares slope of the rows' seconds over their KV bytes, inverted."""
        xs = [self.kv_bytes(b, n) for b, n, _ in self.rows]
        ys = [s for _, _, s in self.rows]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        return 1.0 / slope


@dataclass(frozen=True)
class AttentionTable:
    source: str
    kernels: tuple[AttentionKernel, ...]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _kernel(entry: object, where: str) -> AttentionKernel:
    if not isinstance(entry, dict):
        raise HexError(where, "must be an object with gpu_type, q_heads, kv_heads, head_dim and rows", _FIX)
    gpu_type = entry.get("gpu_type")
    if not isinstance(gpu_type, str) or not gpu_type:
        raise HexError(f"{where}.gpu_type", "must name a GPU type", _FIX)
    for key in ("q_heads", "kv_heads", "head_dim"):
        if not _whole(entry.get(key)):
            raise HexError(f"{where}.{key}", "must be a whole number >= 1", _FIX)
    rows = entry.get("rows")
    if not isinstance(rows, list) or len(rows) < 2:
        raise HexError(f"{where}.rows", "must hold at least 2 rows of [batch, kv_len, microseconds]", _FIX)
    out = []
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == 3 and _whole(row[0]) and _whole(row[1])
        if not ok or isinstance(row[2], bool) or not isinstance(row[2], int | float) or not 0 < row[2] < 1e9:
            raise HexError(f"{where}.rows[{i}]", "must be [batch >= 1, kv_len >= 1, microseconds > 0]", _FIX)
        out.append((row[0], row[1], row[2] / 1e6))
    kernel = AttentionKernel(gpu_type, entry["q_heads"], entry["kv_heads"], entry["head_dim"], tuple(out))
    if len({kernel.kv_bytes(b, n) for b, n, _ in out}) < 2:
        raise HexError(f"{where}.rows", "must cover at least 2 different KV sizes", _FIX)
    if kernel.streaming_rate() <= 0:
        raise HexError(f"{where}.rows", "must take longer for more KV (the seconds fall as KV grows)", _FIX)
    return kernel


@cache
def load_attention(path: Path = ATTENTION) -> AttentionTable:
    """The kernel file at ``path``, checked whole: every problem is a :class:`HexError` naming where it is."""
    where = str(path)
    data = read_format(path, FORMAT, where, "a decode-attention kernel file", _FIX)
    source = data.get("source")
    if not isinstance(source, str) or not source:
        raise HexError(
            f"{where}: source", "must name where the measurements come from and their license", _FIX
        )
    kernels = data.get("kernels")
    if not isinstance(kernels, list) or not kernels:
        raise HexError(f"{where}: kernels", "must list at least one measured kernel", _FIX)
    return AttentionTable(source, tuple(_kernel(k, f"{where}: kernels[{i}]") for i, k in enumerate(kernels)))


def attention_checks(
    calibration: Calibration, types: Sequence[str] | None = None, table: AttentionTable | None = None
) -> list[dict[str, Any]]:
    """Per GPU type with measured kernels (of ``types``, all when None; the built-in catalog's HBM figures): the
    fraction of HBM each kernel streams KV at, their median, and the calibration's ``hbm_fraction`` with its
    source; ``ratio`` is how many times faster the kernels stream KV than the model reads it."""
    table = table or load_attention()
    catalog = build_catalog()
    by_type: dict[str, list[AttentionKernel]] = {}
    for kernel in table.kernels:
        name = catalog.canonical(kernel.gpu_type)
        if name is not None and (types is None or name in types):
            by_type.setdefault(name, []).append(kernel)
    out = []
    for gpu_type, kernels in by_type.items():
        hbm = catalog.get(gpu_type).hbm_bytes_per_s
        fractions = {k.layout: round(k.streaming_rate() / hbm, 3) for k in kernels}
        measured = statistics.median(fractions.values())
        fitted = calibration.for_gpu(gpu_type).hbm_fraction
        out.append(
            {
                "gpu_type": gpu_type,
                "kernels": fractions,
                "kernel_fraction": measured,
                "hbm_fraction": fitted,
                "hbm_fraction_source": calibration.source(gpu_type, "hbm_fraction"),
                "ratio": round(measured / fitted, 3),
                "source": table.source,
            }
        )
    return out
