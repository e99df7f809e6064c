"""Rollout replica model: per-iteration decode latency (``costmodel/decode.py``), admission and long-tail drain.

One decode iteration of ``a`` sequences at context ``ctx`` takes ``decode_iteration_s`` (a roofline with physical
factors: weights and every sequence's KV read at ``hbm_fraction`` of HBM, FLOPs at ``infer_mfu``, TP all-reduces,
a per-iteration overhead). The batch is as many sequences as SGLang's KV pool holds (what
``sglang.mem_fraction_static`` leaves after the weights, :func:`~areal_hex_plugin.costmodel.memory.rollout_kv_budget`),
at most SGLang's CUDA-graph batch limit (``CUDA_GRAPH_MAX_BS``) and at most the sequences admission lets in
(``max_sequences``: upstream admits ``max_concurrent_rollouts`` rollouts within the staleness bound, and a rollout
holds its slot until its longest sample ends, so with samples at the 27,648-token cap a replica may run far
fewer sequences than it could hold; ``CostModel.staleness_sequences``). The replica runs that batch continuously
(by Little's law a step takes its tokens at the batch's rate); where a step's generation must end before the next
may start (eta = 0, a window that drains) it also waits for its longest sample. Prefill is compute-bound and adds
its time once per prompt (the radix cache shares it between a rollout's samples).

A weight update throws the in-flight KV away. Upstream asks SGLang to abort every request with the update
(areal 1.0.4 ``engine/sglang_remote.py``, ``build_distributed_weight_update_requests``: ``"abort_all_requests":
True``; the disk path sends the same flag), SGLang flushes its radix cache once the new weights are in (sglang
0.5.x ``managers/scheduler_update_weights_mixin.py``, ``update_weights_from_distributed``: ``if
recv_req.flush_cache: self.flush_cache()``), and upstream's client resubmits each aborted request with its prompt
plus every token generated so far (``infra/remote_inf_engine.py``, ``agenerate``: ``req.input_ids +=
gen_result.output_tokens`` in the ``while stop_reason not in [...]`` loop). So after every update each replica
prefills its whole in-flight context again, at the compute-bound prefill rate with the causal attention over it:
``RolloutEstimate.recompute_s``, charged to rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import areal_hex_plugin.costmodel.kernel_data as kernel_data
from areal_hex_plugin.costmodel.calibration import GENERIC_SOURCE, Calibration
from areal_hex_plugin.costmodel.decode import (
    ROOFLINE,
    DecodeReplica,
    DecodeStage,
    decode_iteration_s,
    roofline_s,
)
from areal_hex_plugin.costmodel.lengths import LengthStats
from areal_hex_plugin.costmodel.links import between_stages, gpu_link
from areal_hex_plugin.costmodel.memory import (
    GB,
    kv_bytes_per_token,
    rollout_kv_budget,
    split_layers,
    stage_params,
)
from areal_hex_plugin.costmodel.stages import layout_problem
from areal_hex_plugin.specs.cluster import Cluster, Pool
from areal_hex_plugin.specs.workload import WorkloadSpec

# SGLang's default ``cuda_graph_max_bs`` (server_args, per GPU memory and TP size; sglang 0.5.x, which
# areal 1.0.4 pins): (min HBM GB, batch limit below TP4, batch limit at TP4 and above); the first row the card
# reaches applies. Decode batches above it run without CUDA graphs and pay the kernel-launch cost of every layer
# on each step, so the plan keeps a replica's batch within it (the in-flight cap it writes bounds the batch).
CUDA_GRAPH_MAX_BS = ((90.0, 256, 512), (60.0, 256, 512), (35.0, 32, 160), (20.0, 24, 80), (0.0, 8, 64))
# Latency of one small NCCL all-reduce inside a machine, and of one pipeline hand-off between machines.
ALLREDUCE_LATENCY_S = 10e-6
HANDOFF_LATENCY_S = 50e-6


@dataclass(frozen=True, order=True)
class RolloutStage:
    """One pipeline stage of a rollout replica: ``tp`` GPUs inside one machine of ``pool``."""

    pool: str
    tp: int


@dataclass(frozen=True)
class RolloutEstimate:
    feasible: bool
    reason: str
    tokens_per_s: float  # steady generated tokens/s of one replica over a staleness window
    gpus: dict[str, int] = field(hash=False)  # pool -> GPUs
    # Sequences in flight when the batch is full: KV capacity / mean in-flight context, at most SGLang's
    # CUDA-graph batch limit and the caller's ``max_sequences`` (the planner's share of the staleness capacity).
    concurrency: int
    weights_gb_per_gpu: float  # largest over stages
    kv_gb_per_gpu: float  # KV-cache budget per GPU on the tightest stage
    layers: tuple[int, ...] = ()
    peak_tokens_per_s: float = 0.0  # decode rate with the batch full (no prefill, no drain)
    step_time_s: float = 0.0  # one decode step with the batch full
    bound: str = ""  # what limits the full-batch decode step: "hbm", "compute" or "communication"
    kv_capacity_tokens: int = 0
    # After each weight update upstream aborts and resubmits in-flight requests, so the replica prefills their
    # prompts (once per rollout: the radix cache shares them) and generated tokens again before decoding on.
    recompute_s: float = 0.0
    prefill_s_per_token: float = 0.0  # compute-bound prefill (new prompts and the rebuild after an update)
    decode_source: str = (
        ROOFLINE  # where the full-batch iteration's seconds come from: KERNEL_DATA or ROOFLINE
    )
    # Seconds the step's longest sample (``LengthStats.step_longest``) decodes: a step's rollout ends no earlier
    # where it waits for it (eta 0, a window that drains: ``inflight.as_run``).
    longest_s: float = 0.0
    # What a pipeline that drains before a weight update (admission stopped, nothing new to decode beside the
    # survivors; every step at eta = 0) adds to the window: the longest sample's seconds less those of the tokens
    # the batch in flight still had to generate at full speed (``planner/inflight.py``, ``drains``).
    drain_s: float = 0.0

    @property
    def n_gpus(self) -> int:
        return sum(self.gpus.values())


def _infeasible(reason: str, gpus: dict[str, int]) -> RolloutEstimate:
    return RolloutEstimate(False, reason, 0.0, gpus, 0, 0.0, 0.0)


def _check_stages(cluster: Cluster, workload: WorkloadSpec, stages: tuple[RolloutStage, ...]) -> str:
    if any(s.tp < 1 for s in stages):
        return f"tp must be at least 1, got {min(s.tp for s in stages)}"
    return layout_problem(cluster, workload.model, [(s.pool, s.tp, s.tp) for s in stages], "replica")


def _build_stages(
    cluster, workload, calibration: Calibration, stages, layers, gpus
) -> tuple[DecodeReplica, float]:
    """The replica's decode constants (:mod:`~areal_hex_plugin.costmodel.decode`) and one prompt's prefill
    seconds on its slowest stage."""
    model = workload.model
    params = stage_params(model, layers)
    q_dim = model.heads * model.dim_per_head
    prompt = workload.prompt_tokens
    built, prefill = [], 0.0
    for i, (s, n, p) in enumerate(zip(stages, layers, params, strict=True)):
        pool = cluster.pool(s.pool)
        eff = calibration.for_gpu(pool.gpu_type)
        hbm = pool.gpu.hbm_bytes_per_s * eff.hbm_fraction
        flops = pool.gpu.flops * eff.infer_mfu
        compute_params = n * model.params_per_layer + (
            model.vocab * model.hidden if i == len(stages) - 1 else 0
        )
        ar_s, ar_seq = 0.0, 0.0
        if s.tp > 1:
            link = gpu_link(pool, calibration)
            ar_s = 2 * n * ALLREDUCE_LATENCY_S
            ar_seq = 2 * n * model.hidden * 2 * 2 * (s.tp - 1) / s.tp / link
        ho_s, ho_seq = 0.0, 0.0
        if i + 1 < len(stages):
            nxt = cluster.pool(stages[i + 1].pool)
            link = between_stages(cluster, calibration, pool, nxt, gpus[pool.name] <= pool.gpus_per_machine)
            ho_s, ho_seq = HANDOFF_LATENCY_S, model.hidden * 2 / link
        prefill_flops = 2 * compute_params * prompt + 2 * prompt * prompt * q_dim * n
        prefill = max(prefill, prefill_flops / s.tp / flops + ar_seq * prompt)
        built.append(
            DecodeStage(
                weight_s=p * 2 / s.tp / hbm,
                lin_flop_s=2 * compute_params / s.tp / flops,
                kv_read_s=kv_bytes_per_token(model, n, s.tp) / hbm,
                attn_flop_s=4 * q_dim * n / s.tp / flops,
                allreduce_s=ar_s,
                allreduce_per_seq_s=ar_seq,
                handoff_s=ho_s,
                handoff_per_seq_s=ho_seq,
            )
        )
    types = {cluster.pool(s.pool).gpu_type for s in stages}
    overhead = max(calibration.for_gpu(t).decode_overhead_s for t in types)
    one_type = next(iter(types)) if len(types) == 1 and len({s.tp for s in stages}) == 1 else ""
    replica = DecodeReplica(
        one_type,
        model,
        stages[0].tp,
        tuple(built),
        overhead,
        layer_shares=tuple(n / model.layers for n in layers),
        measured=bool(one_type) and _kernel_data_serves(calibration, one_type, model, stages[0].tp),
    )
    return replica, prefill


def _kernel_data_serves(calibration: Calibration, gpu_type: str, model, tp: int) -> bool:
    """Measured kernel data times this type's decode unless its decode factors were measured or fitted: a profile
    of the user's own machines is closer to them than NVIDIA's collection, and the fit reads the roofline."""
    if any(calibration.source(gpu_type, f) != GENERIC_SOURCE for f in ("hbm_fraction", "infer_mfu")):
        return False
    return kernel_data.decode_iteration_s(gpu_type, model, tp, 1, 1024) is not None


def estimate_rollout(
    cluster: Cluster,
    workload: WorkloadSpec,
    calibration: Calibration,
    lengths: LengthStats,
    stages: tuple[RolloutStage, ...],
    max_sequences: int | None = None,
) -> RolloutEstimate:
    """One replica's window throughput and memory, or ``feasible=False`` with the reason (never raises)."""
    gpus = _gpus_by_pool(stages)
    problem = _check_stages(cluster, workload, stages)
    if problem:
        return _infeasible(problem, gpus)
    model = workload.model
    pools = [cluster.pool(s.pool) for s in stages]
    layers = _split(model.layers, stages, pools, calibration)
    params = stage_params(model, layers)
    weights = [p * 2 / s.tp for p, s in zip(params, stages, strict=True)]
    fraction = workload.rl.mem_fraction_static
    budgets = [rollout_kv_budget(pool.gpu, w, fraction) for pool, w in zip(pools, weights, strict=True)]
    per_token = [kv_bytes_per_token(model, n, s.tp) for n, s in zip(layers, stages, strict=True)]
    capacity = min(max(0.0, b) / t for b, t in zip(budgets, per_token, strict=True))
    tight = min(range(len(stages)), key=lambda i: max(0.0, budgets[i]) / per_token[i])
    where = _describe(model.name, stages, pools, tight)
    longest = workload.prompt_tokens + workload.rl.max_new_tokens
    if budgets[tight] <= 0:
        usable = fraction * pools[tight].gpu.hbm_gb
        return _infeasible(
            f"{where}: {weights[tight] / GB:.1f} GB weights per GPU leave no room for a KV cache in "
            f"{usable:.1f} GB (sglang.mem_fraction_static={fraction:g})",
            gpus,
        )
    if capacity < longest:
        return _infeasible(
            f"{where}: {weights[tight] / GB:.1f} GB weights leave {budgets[tight] / GB:.1f} GB for KV cache, "
            f"fewer than 1 sequence of {longest / 1000:.0f}k tokens",
            gpus,
        )
    ctx = workload.prompt_tokens + lengths.inflight_position
    concurrency = min(max(1, int(capacity / ctx)), _graph_batch_limit(stages, pools))
    if max_sequences:
        concurrency = min(concurrency, max_sequences)
    replica, prefill_one = _build_stages(cluster, workload, calibration, stages, layers, gpus)
    step, source = decode_iteration_s(replica, concurrency, ctx)
    bound = roofline_s(replica, concurrency, ctx)[1]
    peak = concurrency / step
    # Upstream admits new work as rollouts end, so a replica that rollout is waiting on stays as full as admission
    # lets it (``max_sequences``: a rollout holds its slot until its longest sample ends, so the sequences
    # decoding are those of the admitted rollouts that have not ended; Little's law then gives the step). At
    # eta = 0 too: the step's samples queue at the replica and enter as slots free, so only its end drains
    # (``drain_s``, ``planner/inflight.py``'s ``drains``).
    total_tokens = concurrency * lengths.mean
    full_s = total_tokens / peak
    # The n_samples sequences of a rollout share one prompt: SGLang's radix cache prefills it once.
    in_flight_prompts = -(-concurrency // workload.rl.n_samples)
    prefill_s = in_flight_prompts * prefill_one
    tokens_per_s = total_tokens / (full_s + prefill_s)
    # The KV rebuild after an update: each in-flight sequence prefills its prompt (once per rollout) and the
    # tokens generated so far, dense FLOPs per token plus causal attention over them (half the context each).
    recompute_tokens = in_flight_prompts * workload.prompt_tokens + concurrency * lengths.inflight_position
    prefill_s_per_token = max(
        st.lin_flop_s + st.allreduce_per_seq_s + st.handoff_per_seq_s for st in replica.stages
    )
    attention_s = concurrency * ctx * ctx / 2 * max(st.attn_flop_s for st in replica.stages)
    # The step's longest sample decodes one token per iteration, sharing the iterations with the batch that
    # admission keeps full. Where the pipeline drains before an update, the rest of the batch in flight ends
    # before it: the drain is what the longest sample outlasts them by at full speed.
    longest_s = lengths.step_longest * step
    drain_s = max(
        0.0, longest_s - concurrency * lengths.inflight_position / tokens_per_s
    )  # CostModel.batch_work_s
    return RolloutEstimate(
        feasible=True,
        reason="",
        tokens_per_s=tokens_per_s,
        gpus=gpus,
        concurrency=concurrency,
        weights_gb_per_gpu=max(weights) / GB,
        kv_gb_per_gpu=budgets[tight] / GB,
        layers=layers,
        peak_tokens_per_s=peak,
        step_time_s=step,
        bound=bound,
        kv_capacity_tokens=int(capacity),
        recompute_s=recompute_tokens * prefill_s_per_token + attention_s,
        prefill_s_per_token=prefill_s_per_token,
        decode_source=source,
        longest_s=longest_s,
        drain_s=drain_s,
    )


def decode_step_s(
    cluster: Cluster,
    workload: WorkloadSpec,
    calibration: Calibration,
    stages: tuple[RolloutStage, ...],
    batch: float,
    ctx: float,
) -> tuple[float, str]:
    """The cost model's seconds for one decode iteration of ``batch`` sequences at context ``ctx`` on a valid
    layout (``ValueError`` otherwise), and its source: "kernel data" or "roofline"."""
    replica, _ = _valid_replica(cluster, workload, calibration, stages)
    return decode_iteration_s(replica, batch, ctx)


def batch_timings(
    cluster: Cluster,
    workload: WorkloadSpec,
    calibration: Calibration,
    stages: tuple[RolloutStage, ...],
    batches: Sequence[int],
    ctx: float,
) -> list[tuple[float, float]]:
    """Per batch size: the model's seconds to prefill that many fresh prompts, and for one decode step of them at
    context ``ctx``.

    This is what ``areal-hex profile`` times on a real engine, so calibration fits the factors to it. The layout
    must be valid (``ValueError`` otherwise); memory is not checked, since the measured batch did run.
    """
    replica, prefill = _valid_replica(cluster, workload, calibration, stages)
    # The roofline, never kernel data: the profile fit moves the roofline's factors to the engine's timings.
    return [(batch * prefill, roofline_s(replica, batch, ctx)[0]) for batch in batches]


def _valid_replica(
    cluster: Cluster, workload: WorkloadSpec, calibration: Calibration, stages: tuple[RolloutStage, ...]
) -> tuple[DecodeReplica, float]:
    """:func:`_build_stages` of a layout that must be valid (``ValueError`` otherwise); memory is not checked."""
    problem = _check_stages(cluster, workload, stages)
    if problem:
        raise ValueError(problem)
    pools = [cluster.pool(s.pool) for s in stages]
    layers = _split(workload.model.layers, stages, pools, calibration)
    return _build_stages(cluster, workload, calibration, stages, layers, _gpus_by_pool(stages))


def _gpus_by_pool(stages: tuple[RolloutStage, ...]) -> dict[str, int]:
    gpus: dict[str, int] = {}
    for s in stages:
        gpus[s.pool] = gpus.get(s.pool, 0) + s.tp
    return gpus


def _split(
    layers: int, stages: tuple[RolloutStage, ...], pools: list[Pool], calibration: Calibration
) -> tuple[int, ...]:
    """Layers per stage in proportion to each stage's HBM bandwidth (decode is bandwidth-bound)."""
    capability = tuple(
        s.tp * p.gpu.hbm_bytes_per_s * calibration.for_gpu(p.gpu_type).hbm_fraction
        for s, p in zip(stages, pools, strict=True)
    )
    split = split_layers(layers, capability)
    assert split is not None  # stage count checked by the caller
    return split


def _graph_batch_limit(stages: tuple[RolloutStage, ...], pools: list[Pool]) -> int:
    """The largest decode batch SGLang captures as a CUDA graph on the replica's smallest-memory stage."""
    limits = []
    for s, pool in zip(stages, pools, strict=True):
        _, small_tp, large_tp = next(row for row in CUDA_GRAPH_MAX_BS if pool.gpu.hbm_gb >= row[0])
        limits.append(small_tp if s.tp < 4 else large_tp)
    return min(limits)


def _describe(model: str, stages: tuple[RolloutStage, ...], pools: list[Pool], index: int) -> str:
    short = model.split("-")[-1] if "-" in model else model
    layout = (
        f"TP{stages[index].tp}"
        if len(stages) == 1
        else f"stage {index} (TP{stages[index].tp}) of PP{len(stages)}"
    )
    return f"{short} at {layout} on {pools[index].gpu_type}"
