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


def measure(
    model,
    batch_sizes: tuple[int, ...],
    context: int,
    train_tokens: int,
    device: str = "cuda",
    copy_mib: int = 1024,
) -> dict:
    """Time model-shaped kernels on ``device`` (torch is imported here only)."""
    import torch
    import torch.nn.functional as F
    import torch.utils.checkpoint

    dtype = torch.bfloat16
    q_dim, kv_dim = model.heads * model.dim_per_head, model.kv_width
    layer_params = model.hidden * (q_dim + 2 * kv_dim) + q_dim * model.hidden + 3 * model.hidden * model.ffn

    def timed(fn, repeat: int = 5) -> float:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / repeat
        import time

        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) / repeat

    # Enough layers that the weights do not sit in L2 cache (at least ~1 GB), at most the model's own.
    layers = max(1, min(model.layers, -(-int(1e9) // (2 * layer_params)))) if device == "cuda" else 1
    weights = [
        (
            torch.randn(model.hidden, q_dim + 2 * kv_dim, device=device, dtype=dtype),
            torch.randn(q_dim, model.hidden, device=device, dtype=dtype),
            torch.randn(model.hidden, 2 * model.ffn, device=device, dtype=dtype),
            torch.randn(model.ffn, model.hidden, device=device, dtype=dtype),
        )
        for _ in range(layers)
    ]

    def dense(x, attn_out, mlp_act):
        """The four GEMMs of one decode step per layer (activations are stand-ins of the right shape)."""
        for qkv, o, up, down in weights:
            x @ qkv
            attn_out @ o
            x @ up
            mlp_act @ down

    decode = []
    for b in batch_sizes:
        x = torch.randn(b, model.hidden, device=device, dtype=dtype)
        attn_out = torch.randn(b, q_dim, device=device, dtype=dtype)
        mlp_act = torch.randn(b, model.ffn, device=device, dtype=dtype)
        q = torch.randn(b, model.heads, 1, model.dim_per_head, device=device, dtype=dtype)
        k = torch.randn(b, model.kv_heads, context, model.dim_per_head, device=device, dtype=dtype)
        v = torch.randn_like(k)

        def attention(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=model.kv_heads != model.heads)

        decode.append(
            {
                "batch": b,
                "context": context,
                "dense_s": timed(lambda x=x, a=attn_out, m=mlp_act: dense(x, a, m)),
                "dense_flops": 2 * layer_params * b * layers,
                "weight_bytes": 2 * layer_params * layers,
                "attention_s": timed(attention),
                "kv_bytes": k.numel() * 2 * 2,
            }
        )
        del k, v

    seqs = max(1, train_tokens // 4096)
    seq = max(1, train_tokens // seqs)
    block = _train_block(model, layers, device, dtype)
    tokens = torch.randn(seqs, seq, model.hidden, device=device, dtype=dtype, requires_grad=True)

    def step():
        out = torch.utils.checkpoint.checkpoint(block, tokens, use_reentrant=False)
        out.float().pow(2).mean().backward()

    step_s = timed(step, repeat=3)
    # Forward, recomputed forward and backward (2x): 8 FLOPs per parameter per token, plus causal attention.
    model_flops = (8 * layer_params + 4 * 4 * q_dim * seq / 2) * seqs * seq * layers
    copy = torch.empty(copy_mib * 1024 * 1024 // 2, device=device, dtype=dtype)
    sink = torch.empty_like(copy)
    copy_s = timed(lambda: sink.copy_(copy))
    return {
        "format": MEASUREMENTS_FORMAT,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else device,
        "model": model.name,
        "layers_timed": layers,
        "copy_gb_per_s": 2 * copy.numel() * 2 / copy_s / 1e9,
        "decode": decode,
        "train": {"tokens": seqs * seq, "step_s": step_s, "model_flops": model_flops},
    }


def _train_block(model, layers: int, device: str, dtype):
    import torch
    import torch.nn.functional as F

    q_dim, kv_dim = model.heads * model.dim_per_head, model.kv_width

    class Block(torch.nn.Module):
        """``layers`` decoder layers (attention + SwiGLU MLP) with the model's shapes; no norms or biases."""

        def __init__(self) -> None:
            super().__init__()
            make = lambda i, o: torch.nn.Linear(i, o, bias=False, device=device, dtype=dtype)  # noqa: E731
            self.layers = torch.nn.ModuleList(
                torch.nn.ModuleList([make(model.hidden, q_dim + 2 * kv_dim), make(q_dim, model.hidden),
                                     make(model.hidden, 2 * model.ffn), make(model.ffn, model.hidden)])
                for _ in range(layers)
            )  # fmt: skip

        def forward(self, x):
            b, s, _ = x.shape
            d = model.dim_per_head
            for qkv, o, up, down in self.layers:
                q, k, v = qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
                q = q.view(b, s, model.heads, d).transpose(1, 2)
                k = k.view(b, s, model.kv_heads, d).transpose(1, 2)
                v = v.view(b, s, model.kv_heads, d).transpose(1, 2)
                attn = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=model.kv_heads != model.heads
                )
                x = x + o(attn.transpose(1, 2).reshape(b, s, q_dim))
                gate, lin = up(x).chunk(2, dim=-1)
                x = x + down(F.silu(gate) * lin)
            return x

    return Block()


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
        import torch

        if not torch.cuda.is_available():
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
