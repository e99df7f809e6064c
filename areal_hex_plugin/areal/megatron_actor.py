"""``HexMegatronPPOActor``: upstream's Megatron PPO actor with the plan's per-stage layer counts, and
``HexMegatronRelayActor``: the same with the relay transport (``hex.transport: relay``), each pipeline stage
sending the layers it holds.

Importable only where megatron-core is installed (the ``megatron`` extra, GPU machines). Registered by path in
``areal/plugin.py``; each actor worker reads the plan's split from its environment (``HEX_PP_LAYERS``, set by the
placement) and hands it to megatron-core as ``pipeline_model_parallel_layout`` in place of upstream's
parameter-balanced split. GPU check: ``tests/gpu/megatron_check.py``.

The relay uses the seams upstream's xccl path has: upstream's loop already has every pipeline head (dp 0, tp 0 of
each stage) gather its stage's tensors across TP, convert them to HF names (the same ``convert_to_hf`` as xccl)
and hand each bucket to ``_update_bucket_weights_from_distributed``; here that bucket goes to the stage's part of
the version (``transport/train_side.py``) instead of one NCCL broadcast from each head, and no NCCL group with
the rollout servers is made, so upstream's train pp = rollout pp rule does not apply.
"""

from __future__ import annotations

import os

from areal.engine import megatron_engine
from areal.engine.megatron_engine import MegatronPPOActor

from areal_hex_plugin.areal.megatron_layout import layer_stage, planned_layers, stage_layout
from areal_hex_plugin.areal.plugin import swapped
from areal_hex_plugin.fast_exit import freeze_heap_at_exit
from areal_hex_plugin.transport.train_side import RelayTrainSide


def planned_layer_splits(layers: tuple[int, ...]):
    """A stand-in for upstream's ``configure_pipeline_layer_splits`` that sets the planned ``layers``."""

    def configure(parallel_strategy, hf_config, tf_config):
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        pp = parallel_strategy.pipeline_parallel_size
        vpp = parallel_strategy.virtual_pipeline_parallel_size or 1
        layout = stage_layout(layers, pp, vpp, tf_config.num_layers)
        tf_config.pipeline_model_parallel_layout = PipelineParallelLayerLayout(
            layout=layout, pipeline_model_parallel_size=pp
        )
        # As upstream does when it sets a layout: the layout alone decides the split.
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            if hasattr(tf_config, name):
                setattr(tf_config, name, None)
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            if hasattr(tf_config, name):
                setattr(tf_config, name, False)
        return tf_config

    return configure


class HexMegatronPPOActor(MegatronPPOActor):
    def initialize(self, *args, **kwargs):
        freeze_heap_at_exit()  # upstream's worker then exits within its grace (fast_exit.py)
        layers = planned_layers(os.environ)
        if not layers:
            return super().initialize(*args, **kwargs)
        with swapped(megatron_engine, "configure_pipeline_layer_splits", planned_layer_splits(layers)):
            return super().initialize(*args, **kwargs)


class HexMegatronRelayActor(RelayTrainSide, HexMegatronPPOActor):
    """Keep ``weight_update_mode: xccl`` in the recipe; the controller configures the route before updates."""

    def hex_parts(self) -> int:
        from megatron.core import parallel_state as mpu

        return mpu.get_pipeline_model_parallel_world_size()

    def hex_part_index(self) -> int | None:
        from megatron.core import parallel_state as mpu

        return mpu.get_pipeline_model_parallel_rank() if self.is_pipeline_parallel_head() else None

    def _init_weight_update_from_distributed(self, meta) -> None:
        # No NCCL group with the rollout servers: the stages reach the receivers through the route.
        self.weight_update_master_addr = ""
        self.weight_update_master_port = 0

    def _update_weights_from_distributed(self, meta) -> None:
        self.hex_begin(meta.version if meta.version is not None else self.get_version() + 1)
        super()._update_weights_from_distributed(meta)  # pause, every head's buckets, resume
        self.hex_finish()

    def _update_bucket_weights_from_distributed(self, meta, converted_named_tensors) -> None:
        """A pipeline head's bucket of HF tensors: checked against the plan's stage, then sent as this stage's."""
        if not converted_named_tensors:
            return
        layers, stage = planned_layers(os.environ), self.hex_part_index()
        for name, _ in converted_named_tensors if layers else ():
            held_by = layer_stage(name, layers)
            if held_by not in (None, stage):
                raise RuntimeError(
                    f"pipeline stage {stage} holds {name}, which the plan's layers {list(layers)} put on stage "
                    f"{held_by}: megatron-core did not build the planned layout"
                )
        self.hex_send(list(converted_named_tensors))
        converted_named_tensors.clear()
