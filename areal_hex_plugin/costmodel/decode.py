"""One decode iteration of a rollout replica: the seconds every sequence in its batch takes to advance one token.

Per pipeline stage and TP rank, from the catalog's figures and physical factors (``costmodel/calibration.py``):
``max(weights / HBM, batch * 2 * params / FLOPS) + batch * context * max(KV bytes / HBM, 4 * q_dim / FLOPS)``
with HBM at ``hbm_fraction`` of its bandwidth and FLOPS at ``infer_mfu`` of peak, plus two TP all-reduces per layer
over the machine's GPU link (``link_efficiency``) and the hand-off to the next stage. Pipeline stages run ``pp``
micro-batches, so the slowest stage sets the cycle; every iteration also pays ``decode_overhead_s`` (scheduling,
sampling, the CUDA-graph launch). Where NVIDIA's measured per-op SGLang data covers the replica's GPU type (one
type, one TP, and the type's decode factors not measured or fitted by the user), that data gives the seconds
instead. :func:`decode_iteration_s` is the only place that time is computed: the rollout model, the profile fit
and the reports all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import areal_hex_plugin.costmodel.kernel_data as kernel_data
from areal_hex_plugin.specs.models import ModelShape

ROOFLINE, KERNEL_DATA = "roofline", "kernel data"  # where a decode iteration's seconds come from


@dataclass(frozen=True)
class DecodeStage:
    """Per-TP-rank constants of one pipeline stage, in seconds."""

    weight_s: float  # weights once per iteration
    lin_flop_s: float  # dense FLOPs per sequence per iteration
    kv_read_s: float  # KV read per sequence per context token
    attn_flop_s: float  # attention FLOPs per sequence per context token
    allreduce_s: float  # all-reduces per iteration: fixed latency
    allreduce_per_seq_s: float  # ... and per sequence
    handoff_s: float  # to the next stage: fixed latency
    handoff_per_seq_s: float  # ... and per sequence


@dataclass(frozen=True)
class DecodeReplica:
    """A replica's layout as the decode time needs it: its stages' constants and what identifies it for measured
    kernel data (one GPU type, one TP)."""

    gpu_type: str  # the stages' GPU type ("" when they mix types or TP sizes: no kernel data then)
    model: ModelShape
    tp: int
    stages: tuple[DecodeStage, ...]
    overhead_s: float  # per iteration, outside the kernels (calibration ``decode_overhead_s``)
    layer_shares: tuple[float, ...] = ()  # each stage's share of the model's layers
    measured: bool = False  # measured kernel data may serve (see :func:`decode_iteration_s`)

    @property
    def pp(self) -> int:
        return len(self.stages)


def stage_time(st: DecodeStage, seqs: float, ctx: float) -> tuple[float, str]:
    """One stage's seconds for ``seqs`` sequences at context ``ctx``, and what bounds it."""
    dense = max(st.weight_s, seqs * st.lin_flop_s)
    attention = seqs * ctx * max(st.kv_read_s, st.attn_flop_s)
    comm = st.allreduce_s + seqs * st.allreduce_per_seq_s + st.handoff_s + seqs * st.handoff_per_seq_s
    hbm = (st.weight_s if st.weight_s >= seqs * st.lin_flop_s else 0.0) + (
        seqs * ctx * st.kv_read_s if st.kv_read_s >= st.attn_flop_s else 0.0
    )
    compute = dense + attention - hbm
    bound = max((("hbm", hbm), ("compute", compute), ("communication", comm)), key=lambda kv: kv[1])[0]
    return dense + attention + comm, bound


def roofline_s(replica: DecodeReplica, batch: float, context: float) -> tuple[float, str]:
    """The roofline's seconds per iteration and the slowest stage's bound."""
    micro = min(replica.pp, max(1.0, batch))
    slowest, bound = max(stage_time(st, batch / micro, context) for st in replica.stages)
    return micro * slowest + replica.overhead_s, bound


def measured_s(replica: DecodeReplica, batch: float, context: float) -> float | None:
    """Measured kernel data's seconds per iteration (``costmodel/kernel_data.py``), None where it does not cover
    the point. The table times the whole model; a pipeline stage takes its share of the layers of that time for
    its micro-batch, plus its hand-off, and the slowest stage sets the cycle, as in the roofline."""
    if not replica.measured:
        return None
    micro = min(replica.pp, max(1.0, batch))
    whole = kernel_data.decode_iteration_s(
        replica.gpu_type, replica.model, replica.tp, batch / micro, context
    )
    if whole is None:
        return None
    per_stage = [
        share * whole + st.handoff_s + batch / micro * st.handoff_per_seq_s
        for share, st in zip(replica.layer_shares, replica.stages, strict=True)
    ]
    return micro * max(per_stage)


def decode_iteration_s(replica: DecodeReplica, batch: float, context: float) -> tuple[float, str]:
    """Seconds for each of ``batch`` sequences at mean context ``context`` to advance one token, and where the
    figure came from: measured kernel data where it covers the replica (:func:`measured_s`), else the roofline."""
    seconds = measured_s(replica, batch, context)
    if seconds is not None:
        return seconds, KERNEL_DATA
    return roofline_s(replica, batch, context)[0], ROOFLINE
