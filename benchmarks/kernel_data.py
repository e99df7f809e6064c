"""Kernel-data benchmark: the shipped table's size, load time and lookups per second; with --oracle, the live
aiconfigurator-core calls it stands for.

    .venv/bin/python benchmarks/kernel_data.py --json OUT
    PYTHONPATH=$PWD /tmp/aic/bin/python benchmarks/kernel_data.py --oracle   # venv of scripts/kernel_data.py

Prints (and writes) JSON: ``table`` (``bytes``, ``grids``, ``load_s``), ``lookup`` (``calls``,
``cold_calls_per_s``: the first call per GPU type, model and TP included, ``memoised_calls_per_s``) and, with
``--oracle``, ``oracle`` per system: ``import_s``, ``first_compile_s`` and ``first_call_s`` (its perf data
loading), ``compile_s`` (another TP) and ``decode_call_s`` / ``prefill_call_s`` (warm, median of the grid).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import emit  # benchmarks/report.py, beside this script

from areal_hex_plugin.costmodel import kernel_data
from areal_hex_plugin.specs.models import BUILTIN_MODELS

ROOT = Path(__file__).resolve().parent.parent
GPUS = ("H100", "H200", "A100-80GB", "L40S", "B200", "H800", "H20")
MODELS = ("DeepSeek-R1-Distill-Qwen-1.5B", "DeepSeek-R1-Distill-Qwen-7B", "DeepSeek-R1-Distill-Qwen-14B")
POINTS = [(b, c) for b in (1, 3, 24, 100, 300) for c in (200, 1500, 9000, 27_000)]


def _lookups(repeat: int) -> dict:
    calls = [
        (g, BUILTIN_MODELS[m], tp, b, c)
        for g, m, tp in itertools.product(GPUS, MODELS, (1, 2, 4))
        for b, c in POINTS
    ]
    cold = warm = 0.0
    for _ in range(repeat):
        kernel_data._find.cache_clear()
        t0 = time.perf_counter()
        for call in calls:
            kernel_data.decode_iteration_s(*call)
        t1 = time.perf_counter()
        for call in calls:
            kernel_data.decode_iteration_s(*call)
        cold, warm = cold + t1 - t0, warm + time.perf_counter() - t1
    n = len(calls) * repeat
    return {"calls": len(calls), "cold_calls_per_s": round(n / cold), "memoised_calls_per_s": round(n / warm)}


def _oracle() -> dict:
    spec = importlib.util.spec_from_file_location("kernel_data_script", ROOT / "scripts" / "kernel_data.py")
    script = importlib.util.module_from_spec(spec)
    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    spec.loader.exec_module(script)
    from aiconfigurator_core.sdk.engine import EngineHandle  # noqa: F401  (what the import costs)

    out: dict = {"import_s": round(time.perf_counter() - t0, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = script._config_dir(BUILTIN_MODELS["DeepSeek-R1-Distill-Qwen-7B"], Path(tmp))
        for gpu, system in script.SYSTEMS.items():
            t0 = time.perf_counter()
            oracle = script.Oracle(system, model_dir, 1)
            t1 = time.perf_counter()
            oracle.decode_ms(64, 2048)
            t2 = time.perf_counter()
            script.Oracle(system, model_dir, 2)
            t3 = time.perf_counter()
            row = {"first_compile_s": t1 - t0, "first_call_s": t2 - t1, "compile_s": t3 - t2}
            for name, fn in (("decode_call_s", oracle.decode_ms), ("prefill_call_s", oracle.prefill_ms)):
                times = []
                for b, c in POINTS:
                    t = time.perf_counter()
                    fn(b, c)
                    times.append(time.perf_counter() - t)
                row[name] = statistics.median(times)
            out[gpu] = {k: float(f"{v:.3g}") for k, v in row.items()}
    return out


def bench(repeat: int, oracle: bool) -> dict:
    t0 = time.perf_counter()
    table = kernel_data.load_table()
    load_s = time.perf_counter() - t0
    out = {
        "source": table.source,
        "table": {
            "bytes": kernel_data.TABLE.stat().st_size,
            "grids": len(table.grids),
            "load_s": round(load_s, 3),
        },
        "lookup": _lookups(repeat),
    }
    if oracle:
        out["oracle"] = _oracle()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the results here")
    parser.add_argument("--repeat", type=int, default=3, help="fresh lookup caches (default 3)")
    parser.add_argument("--oracle", action="store_true", help="also time live aiconfigurator-core calls")
    args = parser.parse_args(argv)
    emit(bench(max(1, args.repeat), args.oracle), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
