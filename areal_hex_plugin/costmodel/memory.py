"""Memory footprints: whether a model fits at all, and what one pipeline stage holds per GPU."""

from __future__ import annotations

import math

from areal_hex_plugin.specs.catalog import GpuSpec
from areal_hex_plugin.specs.models import ModelShape

# Mixed-precision Adam under FSDP: bf16 parameters (2) + fp32 gradients (4) + fp32 master weights (4) +
# fp32 Adam moments (8), sharded across the data-parallel group.
TRAIN_BYTES_PER_PARAM = 18
# Share of HBM a framework can use for model state (CUDA context, allocator slack and NCCL buffers take the rest).
USABLE_HBM_FRACTION = 0.9
# Memory a GPU has lost before SGLang measures what is free after loading the weights: the CUDA context, NCCL
# and cuBLAS workspaces (about 1 GB on Hopper cards).
ENGINE_CONTEXT_BYTES = 1e9
GB = 1e9


def min_rollout_gpus(model: ModelShape, gpu: GpuSpec, mem_fraction_static: float) -> int:
    """Fewest GPUs of one type whose share for SGLang (``sglang.mem_fraction_static``) holds the bf16 weights: a
    lower bound (the KV cache of the longest sequence needs room too, see ``costmodel/rollout.py``)."""
    return max(1, math.ceil(model.weight_bytes() / (mem_fraction_static * gpu.hbm_bytes)))


def split_layers(total: int, weights: tuple[float, ...]) -> tuple[int, ...] | None:
    """``total`` layers over stages in proportion to ``weights`` (largest remainder, at least one each)."""
    if len(weights) > total or min(weights) <= 0:
        return None
    shares = [total * w / sum(weights) for w in weights]
    layers = [math.floor(s) for s in shares]
    order = sorted(range(len(weights)), key=lambda i: shares[i] - layers[i], reverse=True)
    for i in order[: total - sum(layers)]:
        layers[i] += 1
    for i, n in enumerate(layers):
        if n == 0:
            layers[i] = 1
            layers[layers.index(max(layers))] -= 1
    return tuple(layers)


def stage_params(model: ModelShape, layers: tuple[int, ...]) -> tuple[int, ...]:
    """Parameters each pipeline stage holds: its layers, the embedding on the first, the LM head on the last."""
    table = model.vocab * model.hidden
    out = []
    for i, n in enumerate(layers):
        params = n * model.params_per_layer
        if i == 0:
            params += table
        if i == len(layers) - 1:
            params += model.hidden  # final norm
            # A tied head shares the embedding only when both sit on one stage.
            if not model.tied_embeddings or len(layers) > 1:
                params += table
        out.append(params)
    return tuple(out)


def kv_heads_per_gpu(model: ModelShape, tp: int) -> int:
    """KV heads one TP rank stores: heads are split, and replicated once TP exceeds their number."""
    return max(1, math.ceil(model.kv_heads / tp))


def kv_bytes_per_token(model: ModelShape, layers: int, tp: int) -> int:
    """bf16 K and V bytes per cached token on one TP rank of a stage with ``layers`` layers (GQA-aware)."""
    return 2 * layers * kv_heads_per_gpu(model, tp) * model.dim_per_head * 2


def rollout_kv_budget(gpu: GpuSpec, weight_bytes_per_gpu: float, mem_fraction_static: float) -> float:
    """HBM bytes of SGLang's KV pool on one rollout GPU (may be negative).

    SGLang sizes the pool as the memory free after loading the weights less the share it keeps for activations
    and CUDA graphs: ``rest_memory = available_gpu_memory - total_gpu_memory * (1 - mem_fraction_static)``
    (sglang 0.5.x ``python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py``,
    ``profile_max_num_token``), i.e. ``mem_fraction_static * total - weights - context``.
    """
    return mem_fraction_static * gpu.hbm_bytes - ENGINE_CONTEXT_BYTES - weight_bytes_per_gpu


def train_activation_bytes(
    model: ModelShape, layers: int, tokens: float, tp: int, last: bool, checkpointing: bool = True
) -> float:
    """Activation bytes per GPU for one micro-batch of ``tokens``.

    With activation checkpointing: each layer's bf16 input, plus the working set of the one layer being
    recomputed (q/k/v, attention output, MLP gate/up/activation: about 10 hidden + 3 ffn bf16 values per token).
    Without it every layer keeps its working set until the backward.
    """
    checkpoints = tokens * model.hidden * 2 * layers
    working = tokens * (10 * model.hidden + 3 * model.ffn) * 2 / tp * (1 if checkpointing else layers)
    # bf16 logits and their gradient on the last stage (upstream's log-softmax runs in fp32 chunks of 1k tokens).
    logits = tokens * model.vocab * 2 * 2 / tp if last else 0.0
    return checkpoints + working + logits


def train_state_bytes(params: int, model: ModelShape, layers: int, dp: int, tp: int) -> float:
    """Optimizer state, gradients and parameters per GPU (FSDP over dp, TP over tp) plus gathered layers."""
    sharded = params * TRAIN_BYTES_PER_PARAM / (dp * tp)
    # FSDP unshards about two layers at a time (the current one and the prefetched next) in bf16.
    gathered = min(layers, 2) * model.params_per_layer * 2 / tp if dp > 1 else 0.0
    return sharded + gathered


def megatron_state_bytes(params: int, model: ModelShape, layers: int, dp: int, tp: int) -> float:
    """Per GPU under Megatron's distributed optimizer: bf16 parameters and fp32 gradients whole on every dp rank
    (TP-split), fp32 master weights and Adam moments sharded over dp."""
    return params / tp * (2 + 4 + (TRAIN_BYTES_PER_PARAM - 6) / dp)
