"""The plan's pipeline stages as Megatron runs them (pure: no megatron import).

Upstream's Megatron engine (areal 1.0.4, megatron-core 0.17) picks its own parameter-balanced split and sets it as
``TransformerConfig.pipeline_model_parallel_layout`` (``areal.engine.megatron_utils.pipeline_parallel``). The
plugin sets the plan's split instead, through the same field: stage k holds ``layers[k]`` decoder layers, the
embedding sits on the first stage and the loss on the last. Which GPUs serve which stage follows from the rank
order (``placement.placement_from_plan``: stage-major, as Megatron's ``tp-cp-ep-dp-pp`` order reads it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from areal_hex_plugin.areal.worker_slots import PP_LAYERS_ENV

_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def planned_layers(env: Mapping[str, str]) -> tuple[int, ...]:
    """The planned layer count of every stage, from an actor worker's environment (empty: not pipelined)."""
    text = env.get(PP_LAYERS_ENV, "").strip()
    return tuple(int(n) for n in text.split()) if text else ()


def stage_layout(layers: Sequence[int], pp_size: int, vpp_size: int, num_layers: int) -> list[list[str]]:
    """Megatron's ``PipelineParallelLayerLayout`` for the planned ``layers``: one list of layer names per stage.

    Raises ``ValueError`` (before any weight is loaded) when the plan and the engine disagree."""
    if vpp_size > 1:
        raise ValueError(
            f"the plan sets one layer count per stage; virtual pipeline size {vpp_size} is not planned"
        )
    if len(layers) != pp_size:
        raise ValueError(f"the plan has {len(layers)} stages but the engine runs pp={pp_size}")
    if sum(layers) != num_layers or min(layers) < 1:
        raise ValueError(f"the planned layers {list(layers)} do not split the model's {num_layers} layers")
    out = [["decoder"] * n for n in layers]
    out[0].insert(0, "embedding")
    out[-1].append("loss")
    return out


def layer_stage(hf_name: str, layers: Sequence[int]) -> int | None:
    """The pipeline stage that holds HF tensor ``hf_name`` when stage k holds ``layers[k]`` decoder layers (the
    relay's senders: each stage sends the layers it holds); None for a tensor outside the decoder layers (the
    embedding goes with the first stage, the final norm and head with the last)."""
    match = _DECODER_LAYER.search(hf_name)
    if match is None:
        return None
    layer, bound = int(match.group(1)), 0
    for stage, count in enumerate(layers):
        bound += count
        if layer < bound:
            return stage
    raise ValueError(f"{hf_name}: layer {layer} is beyond the planned {bound} layers")
