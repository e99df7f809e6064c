"""Memory footprints that decide whether a model fits at all."""

from __future__ import annotations

import math

from areal_hex_plugin.specs.catalog import GpuSpec
from areal_hex_plugin.specs.models import ModelShape

# Mixed-precision Adam under FSDP: bf16 parameters (2) + fp32 gradients (4) + fp32 master weights (4) +
# fp32 Adam moments (8), sharded across the data-parallel group.
TRAIN_BYTES_PER_PARAM = 18
# Share of HBM a framework can use for model state (CUDA context, allocator slack and NCCL buffers take the rest).
USABLE_HBM_FRACTION = 0.9


def min_rollout_gpus(model: ModelShape, gpu: GpuSpec) -> int:
    """Fewest GPUs of one type whose memory holds the bf16 weights with room left for a KV cache."""
    # Weights may take at most half of the usable memory so that a useful KV cache fits beside them.
    return max(1, math.ceil(model.weight_bytes() / (0.5 * USABLE_HBM_FRACTION * gpu.hbm_bytes)))


def min_train_gpus(model: ModelShape, gpu: GpuSpec) -> int:
    """Fewest GPUs of one type whose memory holds the sharded training state (activations not counted)."""
    return max(1, math.ceil(model.params * TRAIN_BYTES_PER_PARAM / (USABLE_HBM_FRACTION * gpu.hbm_bytes)))
