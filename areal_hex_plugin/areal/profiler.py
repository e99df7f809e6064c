"""GPU kernels shaped like a model, timed for ``areal-hex profile`` (the only torch code of the cost model side).

Decode GEMMs at several batch sizes, attention over a KV cache, a checkpointed training block forward and
backward, and a device copy; ``areal_hex_plugin.commands.profile.derive_factors`` turns the timings into
calibration factors.
"""

from __future__ import annotations

from areal_hex_plugin.commands.profile import MEASUREMENTS_FORMAT


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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
