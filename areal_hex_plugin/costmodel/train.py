"""Training-step model (Metis-style): per-stage FLOPs at a per-type MFU, TP/DP/PP communication, FSDP memory.

Each pipeline stage is ``dp x tp`` GPUs of one pool; layers go to stages in proportion to stage compute. A step
trains on ``workload.tokens_per_step`` tokens the way areal 1.0.4's ``RLTrainer`` runs it
(``trainer/rl_trainer.py``): one forward-only pass for the proximal log-probs when
``actor.should_compute_prox_logp()`` (``recompute_logprob``, or the decoupled loss; ``rl.forward_passes``, plus
the reference model's), then ``actor.ppo_update`` over ``ppo_n_minibatches`` minibatches, one optimizer step each
(``trainer/ppo/actor.py``). Per token a pass costs ``2 x params`` FLOPs plus causal attention over the token's
mean attended context: forward, backward (2x) and, with ``actor.gradient_checkpointing``, the forward again
inside the backward. Micro-batches hold at most ``actor.mb_spec.max_tokens_per_mb`` tokens (a longer sequence
gets one of its own; unset, a minibatch is one micro-batch). FSDP gathers bf16 parameters
twice and reduce-scatters fp32 gradients per micro-batch (upstream shards over one dp mesh, across machines too);
a pipeline runs on Megatron, whose distributed optimizer reduce-scatters gradients and all-gathers parameters once
per optimizer step. That traffic overlaps compute, so a stage takes the larger of the two. Pipelines add the 1F1B
bubble; their dp replicas hand activations over in parallel, one link per machine. Every step also pays the
types' ``train_fixed_s`` (work that does not scale with the model: batch gathering and packing, advantages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.links import between_stages, gpu_link, network
from areal_hex_plugin.costmodel.memory import (
    GB,
    USABLE_HBM_FRACTION,
    megatron_state_bytes,
    split_layers,
    stage_params,
    train_activation_bytes,
    train_state_bytes,
)
from areal_hex_plugin.costmodel.stages import layout_problem
from areal_hex_plugin.specs.cluster import Cluster
from areal_hex_plugin.specs.workload import WorkloadSpec

# fp32 master weights + Adam moments read and written, bf16 weights written: bytes moved per parameter by the
# optimizer step (bandwidth-bound).
OPTIMIZER_BYTES_PER_PARAM = 40


@dataclass(frozen=True, order=True)
class TrainStage:
    """One pipeline stage of the trainer: ``dp * tp`` GPUs of ``pool`` (TP inside a machine, DP inside the pool)."""

    pool: str
    dp: int
    tp: int

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class TrainEstimate:
    feasible: bool
    reason: str
    step_time_s: float  # one RL training step (workload.tokens_per_step tokens)
    tokens_per_s: float
    gpus: dict[str, int] = field(hash=False)
    layers: tuple[int, ...] = ()
    memory_gb_per_gpu: tuple[float, ...] = ()
    breakdown: dict[str, float] = field(default_factory=dict, hash=False)  # seconds per step by part

    @property
    def n_gpus(self) -> int:
        return sum(self.gpus.values())


def _machines(stage: TrainStage, pool) -> int:
    return -(-stage.n_gpus // pool.gpus_per_machine)


def _microbatch_tokens(limit: int | None, longest: int, minibatch_per_rank: float) -> float:
    """Tokens in one micro-batch: ``max_tokens_per_mb`` (at least the longest sequence), or the whole minibatch
    share of a DP rank when the recipe sets no limit (upstream's ``MicroBatchSpec(n_mbs=1)``)."""
    if limit is None:
        return max(float(longest), minibatch_per_rank)
    return float(max(limit, longest))


def _infeasible(reason: str, gpus: dict[str, int], layers=(), memory=()) -> TrainEstimate:
    return TrainEstimate(False, reason, math.inf, 0.0, gpus, tuple(layers), tuple(memory))


def _check(cluster: Cluster, workload: WorkloadSpec, stages: tuple[TrainStage, ...]) -> str:
    for s in stages:
        if s.dp < 1 or s.tp < 1:
            return f"dp and tp must be at least 1, got dp={s.dp} tp={s.tp}"
    return layout_problem(cluster, workload.model, [(s.pool, s.tp, s.n_gpus) for s in stages], "trainer")


def estimate_train(
    cluster: Cluster,
    workload: WorkloadSpec,
    calibration: Calibration,
    stages: tuple[TrainStage, ...],
    check_memory: bool = True,
) -> TrainEstimate:
    """One layout's step time, memory and breakdown, or ``feasible=False`` with the reason (never raises).

    ``check_memory=False`` times a layout whatever its memory estimate (calibration against a step that ran).
    """
    gpus: dict[str, int] = {}
    for s in stages:
        gpus[s.pool] = gpus.get(s.pool, 0) + s.n_gpus
    problem = _check(cluster, workload, stages)
    if problem:
        return _infeasible(problem, gpus)
    model, rl = workload.model, workload.rl
    pools = [cluster.pool(s.pool) for s in stages]
    effs = [calibration.for_gpu(p.gpu_type) for p in pools]
    power = tuple(s.n_gpus * p.gpu.flops * e.train_mfu for s, p, e in zip(stages, pools, effs, strict=True))
    layers = split_layers(model.layers, power)
    assert layers is not None
    params = stage_params(model, layers)
    pp = len(stages)

    tokens = workload.tokens_per_step
    longest = workload.prompt_tokens + rl.max_new_tokens
    # Token-weighted mean attended context of a packed causal sequence: E[s^2] / 2E[s].
    seq_mean = workload.mean_sequence_tokens
    seq_sq = workload.output_lengths.mean_square + 2 * workload.prompt_tokens * workload.output_lengths.mean
    attended = (seq_sq + workload.prompt_tokens**2) / (2 * seq_mean)
    q_dim = model.heads * model.dim_per_head
    minibatches = max(1, rl.ppo_n_minibatches)
    forward_passes = rl.forward_passes
    recompute = int(rl.gradient_checkpointing)

    # Pipelines run on Megatron (FSDP has no pipeline parallelism); one stage is upstream's FSDP.
    megatron = pp > 1
    memory: list[float] = []
    parts = {"compute": 0.0, "tp_comm": 0.0, "dp_comm": 0.0, "pp_comm": 0.0, "optimizer": 0.0}
    stage_times: list[float] = []
    mb_sizes: list[float] = []
    works: list[float] = []  # per stage: the per-micro-batch work of the whole step (compute and TP traffic)
    micro_per_minibatch = 1
    for i, (s, pool, eff, n, p) in enumerate(zip(stages, pools, effs, layers, params, strict=True)):
        last = i == pp - 1
        dense = n * model.params_per_layer + (model.vocab * model.hidden if last else 0)
        attn_fwd = 4 * attended * q_dim * n  # per token
        fwd = 2 * dense + attn_fwd
        # Forward, backward (2x), recompute under checkpointing; plus forward-only log-prob passes.
        flops = tokens * ((3 + recompute) * fwd + forward_passes * fwd)
        compute = flops / (s.n_gpus * pool.gpu.flops * eff.train_mfu)

        tp_comm = 0.0
        if s.tp > 1:
            link = gpu_link(pool, calibration)
            # 2 all-reduces per layer forward, 2 backward, 2 recompute; per extra forward pass 2.
            per_token = (
                (4 + 2 * recompute + 2 * forward_passes) * n * model.hidden * 2 * 2 * (s.tp - 1) / s.tp
            )
            tp_comm = tokens / s.dp * per_token / link

        mb_tokens = _microbatch_tokens(rl.max_tokens_per_mb, longest, tokens / minibatches / s.dp)
        mb_sizes.append(mb_tokens)
        # Micro-batches per DP rank per optimizer step (each runs FSDP's gathers once).
        micro = max(1, math.ceil(tokens / minibatches / (s.dp * mb_tokens)))
        micro_per_minibatch = max(micro_per_minibatch, micro)
        dp_comm = 0.0
        if s.dp > 1:
            spans = s.n_gpus > pool.gpus_per_machine
            if spans:
                # Every TP slice's ring crosses the machine's NIC once: the whole stage's bytes per collective.
                bw, volume = network(cluster, pool.name, pool.name), p
            else:
                bw = gpu_link(pool, calibration)
                volume = p / s.tp * (s.dp - 1) / s.dp
            if megatron:
                # Distributed optimizer: one fp32 gradient reduce-scatter and one bf16 parameter all-gather
                # per optimizer step; parameters stay whole on each rank between steps.
                dp_comm = minibatches * volume * (4 + 2) / bw
            else:
                # FSDP (upstream's 1-D dp mesh): two bf16 all-gathers and one fp32 reduce-scatter per
                # micro-batch, one all-gather per micro-batch of each forward-only pass.
                per_micro = volume * (2 * 2 + 4) / bw
                per_forward = volume * 2 / bw
                dp_comm = minibatches * micro * (per_micro + forward_passes * per_forward)

        optimizer = (
            minibatches
            * p
            / s.n_gpus
            * OPTIMIZER_BYTES_PER_PARAM
            / (pool.gpu.hbm_bytes_per_s * eff.hbm_fraction)
        )
        stage_time = max(compute + tp_comm, dp_comm) + optimizer
        stage_times.append(stage_time)
        works.append(compute + tp_comm)
        if stage_time > (max(stage_times[:-1]) if i else 0.0):
            parts.update(compute=compute, tp_comm=tp_comm, dp_comm=dp_comm, optimizer=optimizer)

        state = (megatron_state_bytes if megatron else train_state_bytes)(p, model, n, s.dp, s.tp)
        in_flight = min(pp - i, micro) if pp > 1 else 1  # 1F1B keeps up to pp - i micro-batches' checkpoints
        acts = train_activation_bytes(model, n, mb_tokens, s.tp, last, rl.gradient_checkpointing)
        acts += (in_flight - 1) * mb_tokens * model.hidden * 2 * n
        memory.append((state + acts) / GB)

    pp_comm = 0.0
    for i in range(pp - 1):
        same_machine = stages[i].n_gpus + stages[i + 1].n_gpus <= pools[i].gpus_per_machine
        link = between_stages(cluster, calibration, pools[i], pools[i + 1], same_machine)
        if not same_machine:
            # The dp pipeline replicas hand off in parallel, over every machine the narrower stage spans.
            link *= min(_machines(stages[j], pools[j]) for j in (i, i + 1))
        # bf16 activations forward and their gradients backward, plus the forward-only passes' activations.
        volume = tokens * model.hidden * 2 * (2 + forward_passes)
        pp_comm = max(pp_comm, volume / link)
    slowest = max(stage_times)
    # 1F1B flushes once per optimizer step: pp - 1 micro-batch slots of the slowest stage's per-micro-batch
    # work idle per minibatch (once-per-step traffic and the optimizer do not repeat per micro-batch).
    bubble = max(works) * (pp - 1) / micro_per_minibatch
    fixed = max(e.train_fixed_s for e in effs)
    step = max(slowest + bubble, pp_comm) + fixed
    parts.update(pp_comm=pp_comm, bubble=bubble, fixed=fixed)

    for i, (pool, mem) in enumerate(zip(pools, memory, strict=True)):
        usable = USABLE_HBM_FRACTION * pool.gpu.hbm_gb
        if check_memory and mem > usable:
            s = stages[i]
            where = f"stage {i} of PP{pp}" if pp > 1 else "the trainer"
            return _infeasible(
                f"{model.name} training, {where} (dp={s.dp}, tp={s.tp}, {layers[i]} layers) on {pool.gpu_type}: "
                f"needs {mem:.1f} GB per GPU (state and {int(mb_sizes[i]) // 1024}k-token micro-batch activations), "
                f"{usable:.1f} GB usable",
                gpus,
                layers,
                memory,
            )
    return TrainEstimate(True, "", step, tokens / step, gpus, layers, tuple(memory), parts)
