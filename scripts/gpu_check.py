"""GPU check: time this machine's GPU beside the cost model's prediction for its type.

Needs only PyTorch with CUDA (and transformers for the training step); no SGLang, no network, no model download.
Within about 8 minutes on one GPU it times

* decode iterations of a Qwen2.5-7B-shaped model with random bf16 weights over a batch x context grid: a plain
  PyTorch decoder (cuBLAS GEMMs, grouped-query attention as two batched GEMMs over a static KV cache), each
  iteration captured as one CUDA graph (eager where capture fails; the output says which);
* one training step of a Qwen2.5-1.5B-shaped model (transformers' ``Qwen2ForCausalLM`` from its config, fp32
  weights, bf16 autocast, fused AdamW): the forward-backward and the optimizer step apart;

and prints each beside the cost model's prediction for the GPU (``torch.cuda.get_device_name`` -> the catalog's
type): JSON lines, then a table. The model predicts SGLang's engine and upstream's FSDP trainer, not these plain
kernels, so a ratio far from 1 says where to look, not that either is wrong.

    python scripts/gpu_check.py                         # on a GPU machine (exit 2 without one)
    python scripts/gpu_check.py --dry-run --gpu-type H20  # the predictions only, anywhere
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare copy of the repository

from areal_hex_plugin.costmodel.calibration import Calibration, build_calibration  # noqa: E402
from areal_hex_plugin.costmodel.fit import PROBE, probe_setting  # noqa: E402
from areal_hex_plugin.costmodel.memory import GB, kv_bytes_per_token  # noqa: E402
from areal_hex_plugin.costmodel.rollout import RolloutStage, decode_step_s  # noqa: E402
from areal_hex_plugin.costmodel.train import TrainStage, estimate_train  # noqa: E402
from areal_hex_plugin.errors import HexError  # noqa: E402
from areal_hex_plugin.specs.catalog import BUILTIN_GPUS, GpuCatalog, GpuSpec  # noqa: E402
from areal_hex_plugin.specs.cluster import Pool  # noqa: E402
from areal_hex_plugin.specs.config import CalibrationConfig  # noqa: E402
from areal_hex_plugin.specs.models import BUILTIN_MODELS, ModelShape  # noqa: E402
from areal_hex_plugin.tables import render_table  # noqa: E402

DECODE_MODEL = BUILTIN_MODELS["Qwen2.5-7B"]
TRAIN_MODEL = BUILTIN_MODELS["Qwen2.5-1.5B"]
BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (1024, 4096, 16384)
TRAIN_SEQUENCES, TRAIN_SEQUENCE_TOKENS = 4, 2048
BUDGET_S = 420.0  # the timed part; model set-up and start-up fit in the rest of 8 minutes
PROFILE = "builtin:paper"  # the calibration the paper recipes plan with
CATALOG = GpuCatalog({spec.name: spec for spec in BUILTIN_GPUS})


@dataclass(frozen=True)
class Row:
    """One check: what was timed, the measured and predicted seconds, and where the prediction came from."""

    kind: str  # "decode", "train_fwd_bwd", "train_optimizer", "train_step"
    model: str
    batch: int  # sequences
    context: int  # tokens per sequence (in the KV cache for decode)
    predicted_s: float
    source: str
    measured_s: float | None = None  # None: not run (dry run, or skipped: see note)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """Measured over predicted (above 1: the GPU is slower than the model says)."""
        return None if self.measured_s is None else self.measured_s / self.predicted_s

    def record(self, gpu_type: str, device: str) -> dict[str, Any]:
        return {"gpu_type": gpu_type, "device": device, **asdict(self), "ratio": self.ratio}


def gpu_type_of(device_name: str) -> str:
    """The catalog's type for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'H100'); HexError if unknown."""
    found = CATALOG.canonical(device_name)
    if found is None:
        raise HexError(
            "GPU",
            f"{device_name!r} is not in the GPU catalog",
            f"pass --gpu-type, one of {', '.join(CATALOG.names)}",
        )
    return found


def calibration(profile: str) -> Calibration:
    """The calibration the predictions use: ``profile`` ('none': the built-in defaults)."""
    if profile == "none":
        return Calibration()
    return build_calibration(CalibrationConfig(profile=profile), CATALOG, Path.cwd())


def _pool(gpu: GpuSpec) -> Pool:
    return Pool(PROBE, gpu, 1, 1, (), 0.0, gpu.link_gb_per_s, gpu.link_gb_per_s)


def predict_decode(gpu_type: str, cal: Calibration, batch: int, context: int) -> tuple[float, str]:
    """The cost model's seconds for one decode iteration of the 7B shape at TP1, and their source."""
    cluster, workload = probe_setting(_pool(CATALOG.get(gpu_type)), DECODE_MODEL, 1, context, 1, batch)
    return decode_step_s(cluster, workload, cal, (RolloutStage(PROBE, 1),), batch, context)


def predict_train(
    gpu_type: str, cal: Calibration, sequences: int, tokens: int, checkpointing: bool = False
) -> dict[str, float]:
    """The cost model's seconds for one training step of the 1.5B shape on one GPU: forward-backward
    (``fwd_bwd``), optimizer and the whole step, as :func:`measure_train` runs it (no log-prob pass, one
    minibatch)."""
    prompt = tokens // 2
    cluster, workload = probe_setting(
        _pool(CATALOG.get(gpu_type)), TRAIN_MODEL, 1, prompt, tokens - prompt, sequences
    )
    rl = replace(workload.rl, recompute_logprob=False, gradient_checkpointing=checkpointing)
    est = estimate_train(
        cluster, replace(workload, rl=rl), cal, (TrainStage(PROBE, 1, 1),), check_memory=False
    )
    parts = est.breakdown
    return {"fwd_bwd": parts["compute"], "optimizer": parts["optimizer"], "step": est.step_time_s}


def decode_grid(
    batches: tuple[int, ...] = BATCHES, contexts: tuple[int, ...] = CONTEXTS
) -> list[tuple[int, int]]:
    """(batch, context) points, smallest KV cache first, so a tight budget drops the largest."""
    points = [(b, c) for b in batches for c in contexts]
    return sorted(points, key=lambda p: (p[0] * p[1], p[0]))


def kv_cache_gb(model: ModelShape, batch: int, context: int) -> float:
    return batch * context * kv_bytes_per_token(model, model.layers, 1) / GB


def predictions(
    gpu_type: str, cal: Calibration, grid: list[tuple[int, int]], checkpointing: bool
) -> list[Row]:
    """Every check's row with its prediction (nothing measured yet)."""
    rows = []
    for batch, context in grid:
        seconds, source = predict_decode(gpu_type, cal, batch, context)
        rows.append(Row("decode", DECODE_MODEL.name, batch, context, seconds, source))
    train = predict_train(gpu_type, cal, TRAIN_SEQUENCES, TRAIN_SEQUENCE_TOKENS, checkpointing)
    for part in ("fwd_bwd", "optimizer", "step"):
        kind = "train_step" if part == "step" else f"train_{part}"
        rows.append(
            Row(kind, TRAIN_MODEL.name, TRAIN_SEQUENCES, TRAIN_SEQUENCE_TOKENS, train[part], "roofline")
        )
    return rows


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


def table(rows: list[Row]) -> str:
    headers = ("check", "batch", "context", "measured ms", "model ms", "measured/model", "model from", "note")
    body = [
        (r.kind, r.batch, r.context, _ms(r.measured_s), _ms(r.predicted_s),
         "" if r.ratio is None else f"{r.ratio:.2f}", r.source, r.note)
        for r in rows
    ]  # fmt: skip
    return render_table(headers, body, right=headers[1:6])


def report(rows: list[Row], gpu_type: str, device: str, out=None) -> None:
    """JSON lines (one per check), then the table, to ``out`` (default: stdout)."""
    out = out or sys.stdout
    for r in rows:
        print(json.dumps(r.record(gpu_type, device)), file=out)
    print(
        f"\n{device} as {gpu_type}; {DECODE_MODEL.name} decode at TP1, {TRAIN_MODEL.name} training step",
        file=out,
    )
    print(table(rows), file=out)


# --- The GPU side (torch imported only here) ---------------------------------------------------------------


class Decoder:
    """A Qwen2-shaped decoder with random weights; :meth:`step` is one decode iteration over a static KV cache."""

    def __init__(self, model: ModelShape, device, dtype, seed: int = 0) -> None:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        self.m, self.device, self.dtype = model, device, dtype
        q, kv, d, h, f = model.heads, model.kv_heads, model.dim_per_head, model.hidden, model.ffn

        def w(*size: int):
            return torch.randn(*size, generator=gen, device=device, dtype=dtype) * 0.02

        self.embed = w(model.vocab, h)
        self.lm_head = self.embed if model.tied_embeddings else w(model.vocab, h)
        self.layers = [
            {"qkv": w((q + 2 * kv) * d, h), "qkv_bias": w((q + 2 * kv) * d), "o": w(h, q * d),
             "gate_up": w(2 * f, h), "down": w(h, f), "norm1": torch.ones(h, device=device, dtype=dtype),
             "norm2": torch.ones(h, device=device, dtype=dtype)}
            for _ in range(model.layers)
        ]  # fmt: skip
        self.norm = torch.ones(h, device=device, dtype=dtype)

    def cache(self, batch: int, context: int):
        """K and V of every layer: [layers, 2, batch, kv heads, context, head dim]."""
        import torch

        m = self.m
        return torch.zeros(
            m.layers, 2, batch, m.kv_heads, context, m.dim_per_head, device=self.device, dtype=self.dtype
        )

    def step(self, tokens, kv):
        """Next tokens of ``batch`` sequences whose caches hold ``context`` tokens, the last being written now."""
        import torch
        import torch.nn.functional as F

        m = self.m
        batch, context = tokens.shape[0], kv.shape[4]
        q_heads, kv_heads, d = m.heads, m.kv_heads, m.dim_per_head
        pos = context - 1
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        cos, sin = (f(pos * inv).to(self.dtype).repeat(2) for f in (torch.cos, torch.sin))

        def rope(x):
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            residual = x
            x = F.rms_norm(x, (m.hidden,), layer["norm1"], 1e-6)
            qkv = F.linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split((q_heads * d, kv_heads * d, kv_heads * d), dim=-1)
            q, k = rope(q.view(batch, q_heads, d)), rope(k.view(batch, kv_heads, d))
            kv[i, 0, :, :, pos] = k
            kv[i, 1, :, :, pos] = v.view(batch, kv_heads, d)
            group = q.view(batch, kv_heads, q_heads // kv_heads, d)
            scores = torch.matmul(group, kv[i, 0].transpose(-1, -2)) * d**-0.5
            attn = torch.matmul(torch.softmax(scores.float(), dim=-1).to(self.dtype), kv[i, 1])
            x = residual + F.linear(attn.reshape(batch, q_heads * d), layer["o"])
            residual = x
            gate, up = F.linear(F.rms_norm(x, (m.hidden,), layer["norm2"], 1e-6), layer["gate_up"]).chunk(
                2, dim=-1
            )
            x = residual + F.linear(F.silu(gate) * up, layer["down"])
        return F.linear(F.rms_norm(x, (m.hidden,), self.norm, 1e-6), self.lm_head).argmax(dim=-1)


def time_decode(decoder: Decoder, batch: int, context: int, target_s: float = 0.3) -> tuple[float, str]:
    """Seconds per decode iteration (median of timed rounds) and how it ran: "cuda graph" or "eager (...)"."""
    import torch

    kv = decoder.cache(batch, context)
    tokens = torch.randint(0, decoder.m.vocab, (batch,), device=decoder.device)
    run, mode = (lambda: decoder.step(tokens, kv)), "eager"
    if torch.device(decoder.device).type == "cuda":
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    decoder.step(tokens, kv)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decoder.step(tokens, kv)
            run, mode = graph.replay, "cuda graph"
        except RuntimeError as exc:  # capture unsupported here: time eagerly, and say why
            mode = f"eager ({str(exc).splitlines()[0][:60]})"
    return _median_s(run, decoder.device, target_s), mode


def _median_s(run, device, target_s: float) -> float:
    """Median seconds of ``run`` over rounds, after warm-up; as many calls as fit ``target_s``."""
    import torch

    cuda = torch.device(device).type == "cuda"

    def timed(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            run()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    first = timed(2)
    n = max(1, min(100, int(target_s / 5 / max(first, 1e-6))))
    return sorted(timed(n) for _ in range(5))[2]


def train_model(model: ModelShape, device):
    """transformers' Qwen2ForCausalLM of ``model``'s shape, random fp32 weights on ``device``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.ffn,
        num_hidden_layers=model.layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
        tie_word_embeddings=model.tied_embeddings, max_position_embeddings=32768, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def time_train(net, sequences: int, tokens: int, device, steps: int = 3, checkpointing: bool = False) -> dict:
    """Median seconds of forward-backward and of the AdamW step over ``steps`` steps after one warm-up."""
    import torch

    cuda = torch.device(device).type == "cuda"
    if checkpointing:
        net.gradient_checkpointing_enable()
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-6, fused=cuda)
    ids = torch.randint(0, net.config.vocab_size, (sequences, tokens), device=device)

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    fwd_bwd, optimizer = [], []
    for _ in range(steps + 1):
        start = clock()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        middle = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = clock()
        fwd_bwd.append(middle - start)
        optimizer.append(end - middle)
    median = steps // 2 + 1
    return {"fwd_bwd": sorted(fwd_bwd[1:])[median - 1], "optimizer": sorted(optimizer[1:])[median - 1]}


def measure(rows: list[Row], budget_s: float, checkpointing: bool) -> list[Row]:
    """``rows`` with the GPU's seconds filled in, as far as memory and ``budget_s`` allow."""
    import torch

    started, device, out = time.monotonic(), "cuda", []
    decoder = Decoder(DECODE_MODEL, device, torch.bfloat16)
    for r in (r for r in rows if r.kind == "decode"):
        need = kv_cache_gb(DECODE_MODEL, r.batch, r.context) + r.batch * DECODE_MODEL.vocab * 6 / GB + 2.0
        free = torch.cuda.mem_get_info()[0] / GB
        if need > free:
            out.append(replace(r, note=f"skipped: needs {need:.0f} GB, {free:.0f} GB free"))
        elif time.monotonic() - started > budget_s / 2:
            out.append(replace(r, note="skipped: decode half of the time budget spent"))
        else:
            try:
                seconds, mode = time_decode(decoder, r.batch, r.context)
                out.append(replace(r, measured_s=seconds, note=mode))
            except torch.OutOfMemoryError:
                out.append(replace(r, note="skipped: out of memory"))
            torch.cuda.empty_cache()
        print(json.dumps({"progress": out[-1].kind, "batch": r.batch, "context": r.context,
                          "measured_s": out[-1].measured_s}), file=sys.stderr, flush=True)  # fmt: skip
    del decoder
    torch.cuda.empty_cache()
    train = [r for r in rows if r.kind != "decode"]
    try:
        net = train_model(TRAIN_MODEL, device)
        seconds = time_train(net, TRAIN_SEQUENCES, TRAIN_SEQUENCE_TOKENS, device, checkpointing=checkpointing)
        seconds["step"] = seconds["fwd_bwd"] + seconds["optimizer"]
        out += [replace(r, measured_s=seconds[r.kind.removeprefix("train_")], note="") for r in train]
    except (
        ImportError,
        RuntimeError,
    ) as exc:  # no transformers, or out of memory: say so, keep the decode rows
        out += [replace(r, note=f"not run: {str(exc).splitlines()[0][:80]}") for r in train]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the predictions only (no GPU needed)")
    parser.add_argument("--gpu-type", help="catalog GPU type (default: this machine's GPU)")
    parser.add_argument(
        "--profile", default=PROFILE, help=f"calibration: a profile, or 'none' (default {PROFILE})"
    )
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the timed part")
    parser.add_argument("--checkpointing", action="store_true", help="train with gradient checkpointing")
    args = parser.parse_args(argv)
    try:
        device, cuda = _device()
        if not cuda and not args.dry_run:
            print(
                "error: no CUDA GPU on this machine: gpu_check times one (--dry-run prints the predictions only)"
            )
            return 2
        if not args.gpu_type and not cuda:
            raise HexError("--gpu-type", "is needed without a GPU", f"name one of {', '.join(CATALOG.names)}")
        gpu_type = CATALOG.get(args.gpu_type, "--gpu-type").name if args.gpu_type else gpu_type_of(device)
        rows = predictions(gpu_type, calibration(args.profile), decode_grid(), args.checkpointing)
    except HexError as exc:
        print(f"error: {exc.message}".replace("\n", ";"))
        return 2
    if not args.dry_run:
        rows = measure(rows, args.budget_s, args.checkpointing)
    report(rows, gpu_type, device if cuda else "(dry run)")
    return 0


def _device() -> tuple[str, bool]:
    """This machine's CUDA device name and whether there is one (no torch: none)."""
    try:
        import torch
    except ImportError:
        return "", False
    if not torch.cuda.is_available():
        return "", False
    return torch.cuda.get_device_name(), True


if __name__ == "__main__":
    sys.exit(main())
