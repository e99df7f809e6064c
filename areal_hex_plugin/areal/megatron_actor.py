"""``HexMegatronPPOActor``: upstream's Megatron PPO actor with the plan's per-stage layer counts.

Importable only where megatron-core is installed (the ``megatron`` extra, GPU machines). Registered by path in
``areal/plugin.py``; each actor worker reads the plan's split from its environment (``HEX_PP_LAYERS``, set by the
placement) and hands it to megatron-core as ``pipeline_model_parallel_layout`` in place of upstream's
parameter-balanced split. GPU check: ``tests/gpu/megatron_check.py``.
"""

from __future__ import annotations

import os

from areal.engine import megatron_engine
from areal.engine.megatron_engine import MegatronPPOActor

from areal_hex_plugin.areal.megatron_layout import planned_layers, stage_layout
from areal_hex_plugin.areal.plugin import swapped


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
        layers = planned_layers(os.environ)
        if not layers:
            return super().initialize(*args, **kwargs)
        with swapped(megatron_engine, "configure_pipeline_layer_splits", planned_layer_splits(layers)):
            return super().initialize(*args, **kwargs)
