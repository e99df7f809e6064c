"""The measurements file ``areal-hex profile`` writes (and ``--from-measurements`` reads), as dataclasses whose
fields carry their sane ranges, so a hand-edited or damaged file is refused where it enters, naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_hex_plugin.specs import typed
from areal_hex_plugin.specs.typed import above, between, spec

SECONDS = above(0, 86_400, "s")  # one timed call: more than a day is not a measurement
TOKENS = between(1, 10_000_000, "tokens")


@dataclass
class DecodePoint:
    """One decode batch size: the median prefill (1 token), whole generate and per-step times."""

    batch: int = spec(help="sequences decoded together", range=between(1, 65_536))
    prefill_s: float = spec(help="prefill call of the batch", range=SECONDS)
    step_s: float = spec(help="one decode step of the batch", range=SECONDS)
    generate_s: float | None = spec(None, "the whole timed generate call", SECONDS)


@dataclass
class DecodeMeasurements:
    tp: int = spec(help="tensor-parallel size of the engine", range=between(1, 72))
    prompt_tokens: int = spec(help="prompt length", range=TOKENS)
    decode_tokens: int = spec(help="tokens generated per timed batch", range=between(2, 10_000_000, "tokens"))
    points: list[DecodePoint] = spec(help="one entry per batch size")
    engine: str = spec("", "the engine and its version")


@dataclass
class TrainMeasurements:
    gpus: int = spec(help="GPUs that trained (one machine)", range=between(1, 72))
    sequences: int = spec(help="sequences per step", range=between(1, 65_536))
    sequence_tokens: int = spec(help="tokens per sequence", range=TOKENS)
    step_s: float = spec(help="median PPO update", range=SECONDS)
    logp_s: float = spec(help="median log-prob forward", range=SECONDS)
    allreduce_bus_gb_per_s: float | None = spec(
        None, "all-reduce bus bandwidth (null: one GPU)", above(0, 10_000)
    )
    minibatches: int | None = spec(None, "PPO minibatches per step", between(1, 4_096))
    tokens: int | None = spec(None, "tokens per step", between(1, 65_536 * 10_000_000))
    gradient_checkpointing: bool | None = spec(None, "whether activations were recomputed")
    engine: str = spec("", "the training engine")
    device_name: str = spec("", "the GPU's name")


@dataclass
class Measurements:
    format: str
    gpu_type: str = spec("", "the GPU type measured")
    device_name: str = spec("", "the GPU's name")
    model: str = spec("", "the model measured")
    decode: DecodeMeasurements | None = None
    train: TrainMeasurements | None = None


def check_measurements(data: Any, field: str) -> None:
    """Refuse measurements with a missing, mistyped, non-finite or out-of-range field (``field`` names the
    file's option); the fit reads the checked data."""
    typed.build(Measurements, data, field, strict=True)
