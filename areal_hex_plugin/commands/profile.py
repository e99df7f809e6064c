"""``areal-hex profile --gpu-type X``: measure a GPU's efficiency factors and write a calibration profile.

On the GPU it times model-shaped kernels with torch: a device copy (HBM), one decode step's dense GEMMs at
several batch sizes and its attention over a KV cache (decode), and a forward + recomputed forward + backward
of the model's layers (training). ``--from-measurements FILE`` turns saved measurements into a profile
anywhere. Recipes use the result through ``hex.calibration.profile``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from areal_hex_plugin.errors import HexError

MEASUREMENTS_FORMAT = "areal-hex-measurements/1"
DEFAULT_BATCHES = (1, 16, 64, 256)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("profile", help="measure a GPU type's efficiency factors for the cost model")
    parser.add_argument("--gpu-type", required=True, help="catalog name of the GPU being measured, e.g. H20")
    parser.add_argument(
        "--model", default="Qwen2.5-7B", help="built-in model or HF config.json whose shapes to use"
    )
    parser.add_argument(
        "--batch-sizes",
        default=",".join(map(str, DEFAULT_BATCHES)),
        help="decode batch sizes, comma-separated",
    )
    parser.add_argument("--context", type=int, default=2048, help="KV-cache tokens per sequence for decode")
    parser.add_argument(
        "--train-tokens", type=int, default=8192, help="tokens in the timed training micro-batch"
    )
    parser.add_argument(
        "--from-measurements", metavar="FILE", help="derive the profile from saved measurements"
    )
    parser.add_argument("--json", metavar="OUT", required=True, help="where to write the profile JSON")
    parser.set_defaults(run=run)


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) <= 0:
        raise HexError(
            "--batch-sizes", f"{text!r} is not a list of positive whole numbers", "e.g. 1,16,64,256"
        )
    return sizes


def derive_factors(measurements: dict[str, Any], hbm_tb_per_s: float, tflops_bf16: float) -> dict[str, float]:
    """Efficiency factors from raw measurements and the GPU's catalog figures (capped at 1)."""
    peak_bytes, peak_flops = hbm_tb_per_s * 1e12, tflops_bf16 * 1e12
    try:
        decode = measurements["decode"]
        weight_stream = max(d["weight_bytes"] / d["dense_s"] for d in decode)
        kv_stream = max(d["kv_bytes"] / d["attention_s"] for d in decode)
        dense_flops = max(d["dense_flops"] / d["dense_s"] for d in decode)
        train = measurements["train"]
        train_flops = train["model_flops"] / train["step_s"]
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise HexError(
            "measurements", f"incomplete or malformed measurements ({exc!r})", "re-run the profile"
        ) from None
    factors = {
        "hbm_fraction": max(weight_stream, kv_stream) / peak_bytes,
        "infer_mfu": dense_flops / peak_flops,
        "train_mfu": train_flops / peak_flops,
    }
    if measurements.get("allreduce_bus_gb_per_s") and measurements.get("link_gb_per_s"):
        factors["link_efficiency"] = measurements["allreduce_bus_gb_per_s"] / measurements["link_gb_per_s"]
    return {k: float(f"{min(1.0, v):.4g}") for k, v in factors.items() if v > 0}


def profile_document(gpu_type: str, measurements: dict, factors: dict[str, float]) -> dict:
    from areal_hex_plugin.costmodel.calibration import PROFILE_FORMAT

    return {
        "format": PROFILE_FORMAT,
        "gpu_types": {gpu_type: factors},
        "measurements": {gpu_type: measurements},
    }


def _read_measurements(path: str) -> dict:
    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise HexError(
            "--from-measurements", f"cannot read {file}: {exc.strerror}", "check the path"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HexError(
            "--from-measurements", f"{file} is not JSON", "give a file written by areal-hex profile"
        ) from None
    if isinstance(data, dict) and "measurements" in data and data.get("format") != MEASUREMENTS_FORMAT:
        data = next(iter(data["measurements"].values()), None)  # a whole profile: take its measurements
    if not isinstance(data, dict) or data.get("format") != MEASUREMENTS_FORMAT:
        raise HexError(
            "--from-measurements", f"{file} holds no measurements", f"expected format {MEASUREMENTS_FORMAT!r}"
        )
    return data


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.commands.common import write_json
    from areal_hex_plugin.specs.catalog import build_catalog
    from areal_hex_plugin.specs.models import resolve_model

    gpu = build_catalog().get(args.gpu_type, "--gpu-type")
    if args.from_measurements:
        measurements = _read_measurements(args.from_measurements)
    else:
        from areal_hex_plugin.areal.profiler import cuda_available, measure

        if not cuda_available():
            raise HexError(
                "--gpu-type",
                f"no CUDA GPU on this machine to measure {gpu.name}",
                "run this on a machine with that GPU, or pass --from-measurements FILE",
            )
        model = resolve_model(args.model, "--model")
        measurements = measure(model, _batch_sizes(args.batch_sizes), args.context, args.train_tokens)
    factors = derive_factors(measurements, gpu.hbm_tb_per_s, gpu.tflops_bf16)
    write_json(args.json, profile_document(gpu.name, measurements, factors))
    width = max(map(len, factors))
    print(f"{gpu.name} ({measurements.get('device_name', '?')}):")
    for name, value in factors.items():
        print(f"  {name:<{width}}  {value:.3f}")
    print(f"wrote {args.json}; use it with hex.calibration.profile={args.json}")
    return 0
