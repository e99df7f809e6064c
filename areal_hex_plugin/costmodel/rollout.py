"""Rollout replica model (HexGen-style roofline, GQA-aware, with continuous batching and long-tail drain).

One decode step of ``a`` sequences on one TP rank of a stage costs
``max(weights / HBM, a * 2 * params / FLOPS) + max(a * ctx * KV bytes / HBM, a * 4 * ctx * q_dim / FLOPS)``
plus two TP all-reduces per layer over the machine's GPU link: every step reads the weights once and each
sequence's whole KV cache, so the step grows with the in-flight context ``ctx`` (prompt plus the mean decode
position of the sequences in flight). Pipeline stages run ``pp`` micro-batches; the slowest stage (with its
hand-off) sets the cycle. The batch is as many sequences as SGLang's KV pool holds (the pool is what
``sglang.mem_fraction_static`` leaves after the weights, :func:`~areal_hex_plugin.costmodel.memory.rollout_kv_budget`),
at most SGLang's CUDA-graph batch limit. With a staleness bound eta >= 1 the replica keeps the batch full
(continuous batching); with eta = 0 each batch drains through its long tail. Prefill is compute-bound and adds its
time once per prompt (the radix cache shares it between a rollout's samples; SGLang runs prefill batches apart
from decode batches unless mixed chunking is enabled).

A weight update throws the in-flight KV away. Upstream asks SGLang to abort every request with the update
(areal 1.0.4 ``engine/sglang_remote.py``, ``build_distributed_weight_update_requests``: ``"abort_all_requests":
True``; the disk path sends the same flag), SGLang flushes its radix cache once the new weights are in (sglang
0.5.x ``managers/scheduler_update_weights_mixin.py``, ``update_weights_from_distributed``: ``if
recv_req.flush_cache: self.flush_cache()``), and upstream's client resubmits each aborted request with its prompt
plus every token generated so far (``infra/remote_inf_engine.py``, ``agenerate``: ``req.input_ids +=
gen_result.output_tokens`` in the ``while stop_reason not in [...]`` loop). So after every update each replica
prefills its whole in-flight context again, at the compute-bound prefill rate: ``RolloutEstimate.recompute_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from areal_hex_plugin.costmodel import kernel_data
from areal_hex_plugin.costmodel.calibration import GENERIC_SOURCE, Calibration
from areal_hex_plugin.costmodel.lengths import DrainCurve, LengthStats
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

# Per-step CPU work of the engine (scheduling, sampling, detokenisation hand-off) that CUDA graphs do not hide.
STEP_OVERHEAD_S = 1e-3
# SGLang's default ``cuda_graph_max_bs`` (server_args, per GPU memory and TP size; sglang 0.5.x, which
# areal 1.0.4 pins): (min HBM GB, batch limit below TP4, batch limit at TP4 and above); the first row the card
# reaches applies. Decode batches above it run without CUDA graphs and pay the kernel-launch cost of every layer
# on each step, so the plan keeps a replica's batch within it (the in-flight cap it writes bounds the batch).
CUDA_GRAPH_MAX_BS = ((90.0, 256, 512), (60.0, 256, 512), (35.0, 32, 160), (20.0, 24, 80), (0.0, 8, 64))
ROOFLINE, KERNEL_DATA = "roofline", "kernel data"  # where a decode step's seconds come from
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
    decode_source: str = ROOFLINE  # where that step's seconds come from: "kernel data" or "roofline"
    kv_capacity_tokens: int = 0
    # After each weight update upstream aborts and resubmits in-flight requests, so the replica prefills their
    # prompts (once per rollout: the radix cache shares them) and generated tokens again before decoding on.
    recompute_s: float = 0.0
    prefill_s_per_token: float = 0.0  # compute-bound prefill (new prompts and the rebuild after an update)

    @property
    def n_gpus(self) -> int:
        return sum(self.gpus.values())


@dataclass(frozen=True)
class _Stage:
    """Per-TP-rank constants of one stage, in bytes, FLOPs and seconds."""

    weight_s: float  # weights once per step
    lin_flop_s: float  # dense FLOPs per sequence per step
    kv_read_s: float  # KV read per sequence per context token
    attn_flop_s: float  # attention FLOPs per sequence per context token
    allreduce_s: float  # all-reduces per step: fixed latency
    allreduce_per_seq_s: float  # ... and per sequence
    handoff_s: float  # to the next stage: fixed latency
    handoff_per_seq_s: float  # ... and per sequence
    prefill_s: float  # one prompt's prefill on this stage


def _infeasible(reason: str, gpus: dict[str, int]) -> RolloutEstimate:
    return RolloutEstimate(False, reason, 0.0, gpus, 0, 0.0, 0.0)


def _check_stages(cluster: Cluster, workload: WorkloadSpec, stages: tuple[RolloutStage, ...]) -> str:
    if any(s.tp < 1 for s in stages):
        return f"tp must be at least 1, got {min(s.tp for s in stages)}"
    return layout_problem(cluster, workload.model, [(s.pool, s.tp, s.tp) for s in stages], "replica")


def _build_stages(cluster, workload, calibration: Calibration, stages, layers, gpus) -> list[_Stage]:
    model = workload.model
    params = stage_params(model, layers)
    q_dim = model.heads * model.dim_per_head
    prompt = workload.prompt_tokens
    built = []
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
        built.append(
            _Stage(
                weight_s=p * 2 / s.tp / hbm,
                lin_flop_s=2 * compute_params / s.tp / flops,
                kv_read_s=kv_bytes_per_token(model, n, s.tp) / hbm,
                attn_flop_s=4 * q_dim * n / s.tp / flops,
                allreduce_s=ar_s,
                allreduce_per_seq_s=ar_seq,
                handoff_s=ho_s,
                handoff_per_seq_s=ho_seq,
                prefill_s=prefill_flops / s.tp / flops + ar_seq * prompt,
            )
        )
    return built


def _stage_time(st: _Stage, seqs: float, ctx: float) -> tuple[float, str]:
    dense = max(st.weight_s, seqs * st.lin_flop_s)
    attention = seqs * ctx * max(st.kv_read_s, st.attn_flop_s)
    comm = st.allreduce_s + seqs * st.allreduce_per_seq_s + st.handoff_s + seqs * st.handoff_per_seq_s
    hbm = (st.weight_s if st.weight_s >= seqs * st.lin_flop_s else 0.0) + (
        seqs * ctx * st.kv_read_s if st.kv_read_s >= st.attn_flop_s else 0.0
    )
    compute = dense + attention - hbm
    bound = max((("hbm", hbm), ("compute", compute), ("communication", comm)), key=lambda kv: kv[1])[0]
    return dense + attention + comm, bound


Measured = Callable[[float, float], "float | None"]  # (sequences, context) -> seconds of one decode iteration


def _cycle(
    stages: list[_Stage], seqs: float, ctx: float, measured: Measured | None = None
) -> tuple[float, str, str]:
    """Seconds for every one of ``seqs`` sequences to advance one token (measured kernel data where it covers the
    point, else the roofline), what bounds it (by the roofline), and which of the two gave the seconds."""
    micro = min(len(stages), max(1.0, seqs))
    times = [_stage_time(st, seqs / micro, ctx) for st in stages]
    slowest, bound = max(times)
    seconds = measured(seqs, ctx) if measured else None
    if seconds is None:
        return micro * slowest + STEP_OVERHEAD_S, bound, ROOFLINE
    return seconds, bound, KERNEL_DATA


def measured_decode(
    cluster: Cluster,
    workload: WorkloadSpec,
    calibration: Calibration,
    stages: tuple[RolloutStage, ...],
    layers: tuple[int, ...],
    built: list[_Stage],
) -> Measured | None:
    """Measured kernel data (``costmodel/kernel_data.py``) for a replica whose stages share one GPU type it covers
    and one TP, unless the type's decode factors were measured or fitted: a profile of the user's own machines is
    closer to them than NVIDIA's collection, and the fit reads the roofline. None where the roofline serves.

    The table times the whole model; a pipeline stage takes its share of the layers of that time for its
    micro-batch, plus its hand-off, and the slowest stage sets the cycle, as in the roofline."""
    gpu_types = {cluster.pool(s.pool).gpu_type for s in stages}
    if len(gpu_types) != 1 or len({s.tp for s in stages}) != 1:
        return None
    (gpu_type,) = gpu_types
    if any(calibration.source(gpu_type, f) != GENERIC_SOURCE for f in ("hbm_fraction", "infer_mfu")):
        return None
    model, tp = workload.model, stages[0].tp
    if kernel_data.decode_iteration_s(gpu_type, model, tp, 1, 1024) is None:
        return None
    shares = [n / model.layers for n in layers]

    def seconds(seqs: float, ctx: float) -> float | None:
        micro = min(len(stages), max(1.0, seqs))
        whole = kernel_data.decode_iteration_s(gpu_type, model, tp, seqs / micro, ctx)
        if whole is None:
            return None
        per_stage = [
            share * whole + st.handoff_s + seqs / micro * st.handoff_per_seq_s
            for share, st in zip(shares, built, strict=True)
        ]
        return micro * max(per_stage)

    return seconds


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
    problem = _check_stages(cluster, workload, stages)
    if problem:
        raise ValueError(problem)
    pools = [cluster.pool(s.pool) for s in stages]
    layers = _split(workload.model.layers, stages, pools, calibration)
    built = _build_stages(cluster, workload, calibration, stages, layers, _gpus_by_pool(stages))
    seconds, _, source = _cycle(
        built, batch, ctx, measured_decode(cluster, workload, calibration, stages, layers, built)
    )
    return seconds, source


def _drain_time(
    stages: list[_Stage], c: int, ctx: float, curve: DrainCurve, measured: Measured | None
) -> tuple[float, float]:
    """Expected seconds and tokens of a batch of ``c`` draining along ``curve`` (context grows with age).

    A step runs only while at least one sequence is left, with probability ``1 - (1 - share)^c``; then it carries
    the surviving sequences. Far in the tail that is one long sequence paying a whole weight read per token.
    """
    seconds = tokens = 0.0
    for dt, share, since in curve.steps:
        if share <= 0:
            continue
        running = 1 - (1 - share) ** c
        active = c * share
        seconds += dt * running * _cycle(stages, active / running, ctx + since, measured)[0]
        tokens += dt * active
    return seconds, tokens


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
    built = _build_stages(cluster, workload, calibration, stages, layers, gpus)
    measured = measured_decode(cluster, workload, calibration, stages, tuple(layers), built)
    step, bound, source = _cycle(built, concurrency, ctx, measured)
    peak = concurrency / step
    # With eta >= 1 upstream admits new work while the trainer consumes finished batches, so a replica that
    # rollout is waiting on stays full (the simulator plays this out); only with eta = 0 does every batch start
    # together and drain through its long tail before the next version may start.
    if workload.rl.max_head_offpolicyness == 0:
        drain_s, drain_tokens = _drain_time(
            built, concurrency, workload.prompt_tokens, lengths.drain_from_start, measured
        )
    else:
        drain_s = drain_tokens = 0.0
    total_tokens = concurrency * lengths.mean
    full_s = max(0.0, total_tokens - drain_tokens) / peak
    # The n_samples sequences of a rollout share one prompt: SGLang's radix cache prefills it once.
    in_flight_prompts = -(-concurrency // workload.rl.n_samples)
    prefill_s = in_flight_prompts * max(st.prefill_s for st in built)
    tokens_per_s = total_tokens / (full_s + drain_s + prefill_s)
    recompute_tokens = in_flight_prompts * workload.prompt_tokens + concurrency * lengths.inflight_position
    prefill_s_per_token = max(st.lin_flop_s + st.allreduce_per_seq_s + st.handoff_per_seq_s for st in built)
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
        decode_source=source,
        kv_capacity_tokens=int(capacity),
        recompute_s=recompute_tokens * prefill_s_per_token,
        prefill_s_per_token=prefill_s_per_token,
    )


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
    gpus = _gpus_by_pool(stages)
    problem = _check_stages(cluster, workload, stages)
    if problem:
        raise ValueError(problem)
    pools = [cluster.pool(s.pool) for s in stages]
    layers = _split(workload.model.layers, stages, pools, calibration)
    built = _build_stages(cluster, workload, calibration, stages, layers, gpus)
    prefill = max(st.prefill_s for st in built)
    return [(batch * prefill, _cycle(built, batch, ctx)[0]) for batch in batches]


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
