"""Analytic, calibration-aware cost models (no solver code, no areal/torch imports)."""

from areal_hex_plugin.costmodel.calibration import Calibration, Efficiency
from areal_hex_plugin.costmodel.model import CostModel
from areal_hex_plugin.costmodel.rollout import RolloutEstimate, RolloutStage
from areal_hex_plugin.costmodel.train import TrainEstimate, TrainStage
from areal_hex_plugin.costmodel.weightsync import WeightSyncEstimate

__all__ = [
    "Calibration",
    "CostModel",
    "Efficiency",
    "RolloutEstimate",
    "RolloutStage",
    "TrainEstimate",
    "TrainStage",
    "WeightSyncEstimate",
]
