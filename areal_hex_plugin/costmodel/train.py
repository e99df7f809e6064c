"""Training-step model (Metis-style): per-stage FLOPs at a per-type MFU, TP/DP/PP communication, FSDP memory.

Each pipeline stage is ``dp x tp`` GPUs of one pool; layers go to stages in proportion to stage compute, then move
between stages while the step gets faster (Megatron runs the plan's layer count per stage). A step
trains on ``workload.tokens_per_step`` tokens the way areal 1.0.4's ``RLTrainer`` runs it
(``trainer/rl_trainer.py``): one forward-only pass for the proximal log-probs when
``actor.should_compute_prox_logp()`` (``recompute_logprob``, or the decoupled loss; ``rl.forward_passes``, plus
the reference model's), then ``actor.ppo_update`` over ``ppo_n_minibatches`` minibatches, one optimizer step each
(``trainer/ppo/actor.py``); upstream times the two apart (``timeperf/recompute_logp``, ``ref_logp``, then
``train_step``), so an estimate names the log-prob passes' share (``TrainEstimate.logp_s``). Per token a pass
costs ``2 x params`` FLOPs plus causal attention over the token's mean attended context: forward, backward (2x)
and, with ``actor.gradient_checkpointing``, the forward again inside the backward. Micro-batches hold at most ``actor.mb_spec.max_tokens_per_mb`` tokens (a longer sequence
gets one of its own; unset, a minibatch is one micro-batch). FSDP gathers bf16 parameters
twice and reduce-scatters fp32 gradients per micro-batch (upstream shards over one dp mesh, across machines too);
a pipeline, and every layout of a Megatron actor (``actor.backend=megatron``, one stage too), runs on
Megatron, whose distributed optimizer reduce-scatters gradients and all-gathers parameters once
per optimizer step. FSDP with ``hybrid`` (the paper's space only) shards within each machine and all-reduces the
gradient shards across machines once per optimizer step. That traffic overlaps compute, so a stage takes the
larger of the two. Pipelines add the 1F1B bubble; their dp replicas hand activations over in parallel, one link
per machine. There is no fixed per-step term: every second is FLOPs, bytes over a link or bytes through HBM.

MFU by model size: per layer and token the GEMMs' FLOPs grow as hidden^2, while the memory-bound kernels beside
them (norms, activation functions, rotary, residual adds, the fp32 log-softmax over the vocabulary) grow as hidden;
so the fraction of peak a step reaches is ``train_mfu * hidden / (hidden + MFU_HALF_HIDDEN)`` (``train_mfu``: the
large-model limit). At hidden 1,536 (1.5B) a step spends about 40% of its time outside the GEMMs, at 5,120 (14B)
about 17%. The optimizer step streams its state through HBM at the type's ``hbm_fraction``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.links import between_stages, gpu_link, network
from areal_hex_plugin.costmodel.memory import (
    GB,
    USABLE_HBM_FRACTION,
    megatron_state_bytes,
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
# The hidden size at which the memory-bound kernels take as long as the GEMMs (see the module docstring).
MFU_HALF_HIDDEN = 1024
# A stage's times and memory are affine in its layer count from this many layers on (FSDP gathers up to two).
AFFINE_FROM = 2


@dataclass(frozen=True, order=True)
class TrainStage:
    """One pipeline stage of the trainer: ``dp * tp`` GPUs of ``pool`` (TP inside a machine, DP inside the pool)."""

    pool: str
    dp: int
    tp: int
    # FSDP hybrid sharding: the state sharded within each machine, replicated across machines (the paper's space;
    # upstream 1.0.4's FSDP engine shards over all dp ranks, see planner/caps.py).
    hybrid: bool = False

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
    # Of step_time_s, the forward-only log-prob passes (upstream times them apart: timeperf/recompute_logp and
    # ref_logp); the rest is the update (timeperf/train_step). Their compute and TP traffic on the slowest stage.
    logp_s: float = 0.0

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
    problem = layout_problem(cluster, workload.model, [(s.pool, s.tp, s.n_gpus) for s in stages], "trainer")
    for s in stages if not problem else ():
        machine = cluster.pool(s.pool).gpus_per_machine
        if s.hybrid and len(stages) > 1:
            return "hybrid sharding is FSDP's; a pipeline runs on Megatron"
        if s.hybrid and workload.rl.megatron:
            return "hybrid sharding is FSDP's; actor.backend=megatron runs on Megatron"
        if s.hybrid and (s.n_gpus % machine or s.n_gpus < 2 * machine):
            return (
                f"hybrid sharding shards within each machine and replicates across machines: dp x tp = "
                f"{s.n_gpus} must fill two or more {s.pool} machines of {machine} GPUs"
            )
    samples = workload.rl.samples_per_step
    for s in stages if not problem and workload.rl.even_dispatch else ():
        # Upstream's TrainController deals a step's samples out evenly over the DP ranks (areal 1.0.4
        # infra/controller/train_controller.py _dispatch_tensors: balanced_greedy_partition refuses a count that
        # dp does not divide), so such a layout ends the run at its first training step.
        if samples % s.dp:
            return f"dp={s.dp} does not divide the step's {samples} samples, which upstream deals out evenly"
    return problem


@dataclass(frozen=True)
class _StageCost:
    time: float  # seconds per step: max(compute + TP traffic, DP traffic) + optimizer
    work: float  # compute + TP traffic (what repeats per micro-batch in the pipeline)
    memory_gb: float
    # compute, tp_comm, dp_comm, optimizer, the forward-only passes' share of compute + tp_comm (s); GB per GPU
    parts: tuple[float, float, float, float, float, float]
    microbatch_tokens: float


def estimate_train(
    cluster: Cluster,
    workload: WorkloadSpec,
    calibration: Calibration,
    stages: tuple[TrainStage, ...],
    check_memory: bool = True,
    layers: tuple[int, ...] | None = None,
    memo: dict | None = None,
) -> TrainEstimate:
    """One layout's step time, memory and breakdown, or ``feasible=False`` with the reason (never raises).

    ``layers``: the decoder layers of each stage (None: the split of :func:`_best_split`, which a pipeline
    runs as planned: the plugin hands Megatron one layer count per stage). ``check_memory=False`` times a
    layout whatever its memory estimate (calibration against a step that ran). ``memo``: stage costs (and
    hand-offs) kept across calls with the same cluster, workload and calibration (``CostModel``'s).
    """
    gpus: dict[str, int] = {}
    for s in stages:
        gpus[s.pool] = gpus.get(s.pool, 0) + s.n_gpus
    problem = _check(cluster, workload, stages)
    if problem:
        return _infeasible(problem, gpus)
    step = _Step(cluster, workload, calibration, stages, memo)
    if layers is None:
        layers = step.best_split(check_memory)
    elif len(layers) != len(stages) or sum(layers) != workload.model.layers or min(layers) < 1:
        return _infeasible(
            f"layers {list(layers)} do not split {workload.model.layers} over the stages", gpus
        )
    costs = step.stage_costs(layers)
    time, parts, logp = step.step_time(costs)
    memory = tuple(c.memory_gb for c in costs)
    model, pp = workload.model, len(stages)
    for i, (pool, mem) in enumerate(zip(step.pools, memory, strict=True)):
        usable = USABLE_HBM_FRACTION * pool.gpu.hbm_gb
        if check_memory and mem > usable:
            s = stages[i]
            where = f"stage {i} of PP{pp}" if pp > 1 else "the trainer"
            return _infeasible(
                f"{model.name} training, {where} (dp={s.dp}, tp={s.tp}, {layers[i]} layers) on {pool.gpu_type}: "
                f"needs {mem:.1f} GB per GPU (state and {int(costs[i].microbatch_tokens) // 1024}k-token "
                f"micro-batch activations), {usable:.1f} GB usable",
                gpus,
                layers,
                memory,
            )
    return TrainEstimate(
        True, "", time, workload.tokens_per_step / time, gpus, tuple(layers), memory, parts, logp
    )


def size_mfu(train_mfu: float, hidden: int) -> float:
    """The fraction of peak FLOPS a training step of a model of this hidden size reaches."""
    return train_mfu * hidden / (hidden + MFU_HALF_HIDDEN)


@cache
def _one_layer_params(model, pp: int) -> tuple[int, ...]:
    """Parameters each of ``pp`` stages holds with one layer each (``stage_params`` is affine in the layers)."""
    return stage_params(model, (1,) * pp)


class _Step:
    """The step of one layout as a function of its layer split: per-stage costs, then the pipeline."""

    def __init__(self, cluster, workload, calibration, stages: tuple[TrainStage, ...], memo=None) -> None:
        self.cluster, self.workload, self.calibration, self.stages = cluster, workload, calibration, stages
        model, rl = workload.model, workload.rl
        self.tokens = workload.tokens_per_step
        # Token-weighted mean attended context of a packed causal sequence: E[s^2] / 2E[s].
        seq_sq = (
            workload.output_lengths.mean_square + 2 * workload.prompt_tokens * workload.output_lengths.mean
        )
        self.attended = (seq_sq + workload.prompt_tokens**2) / (2 * workload.mean_sequence_tokens)
        self.minibatches = max(1, rl.ppo_n_minibatches)
        # A stage's cost depends on the stage, its position, the depth and its layers (the rest is the workload's):
        # per stage, its costs by layer count, shared with every layout holding that stage there; and what
        # depends on the stage alone (keyed by the stage), and each hand-off between two stages.
        self._memo = memo = {} if memo is None else memo
        per_stage = [memo.get(s) or memo.setdefault(s, self._per_stage(s)) for s in stages]
        self.pools, self.effs, self.mb_tokens, self.micro = (list(x) for x in zip(*per_stage, strict=True))
        self.pp_comm = self._pp_comm(model)
        self._costs: list[dict] = [  # layer count -> _StageCost, ("room", usable GB) -> layers
            memo.setdefault((s, i, len(stages)), {}) for i, s in enumerate(stages)
        ]
        self._one_layer = _one_layer_params(model, len(stages))
        self._per_layer = model.params_per_layer
        # 1F1B flushes once per optimizer step: pp - 1 micro-batch slots of the slowest stage's per-micro-batch
        # work idle per minibatch (once-per-step traffic and the optimizer do not repeat per micro-batch).
        self._bubble = (len(stages) - 1) / max(self.micro)

    def _per_stage(self, s: TrainStage) -> tuple:
        """The stage's pool, efficiency, tokens per micro-batch and micro-batches per DP rank per optimizer step
        (each runs FSDP's gathers once)."""
        pool, rl = self.cluster.pool(s.pool), self.workload.rl
        longest = self.workload.prompt_tokens + rl.max_new_tokens
        mb = _microbatch_tokens(rl.max_tokens_per_mb, longest, self.tokens / self.minibatches / s.dp)
        micro = max(1, math.ceil(self.tokens / self.minibatches / (s.dp * mb)))
        return pool, self.calibration.for_gpu(pool.gpu_type), mb, micro

    def _pp_comm(self, model) -> float:
        stages, out = self.stages, 0.0
        for i in range(len(stages) - 1):
            key = ("hand-off", stages[i], stages[i + 1])
            found = self._memo.get(key)
            if found is None:
                found = self._memo[key] = self._hand_off(model, i)
            out = max(out, found)
        return out

    def _hand_off(self, model, i: int) -> float:
        """Seconds per step to hand activations from stage i to stage i + 1."""
        stages, pools = self.stages, self.pools
        # bf16 activations forward and their gradients backward, plus the forward-only passes' activations.
        volume = self.tokens * model.hidden * 2 * (2 + self.workload.rl.forward_passes)
        same_machine = stages[i].n_gpus + stages[i + 1].n_gpus <= pools[i].gpus_per_machine
        link = between_stages(self.cluster, self.calibration, pools[i], pools[i + 1], same_machine)
        if not same_machine:
            # The dp pipeline replicas hand off in parallel, over every machine the narrower stage spans.
            link *= min(_machines(stages[j], pools[j]) for j in (i, i + 1))
        return volume / link

    def stage_costs(self, layers: tuple[int, ...]) -> list[_StageCost]:
        return [self._cost(i, n) for i, n in enumerate(layers)]

    def _cost(self, i: int, n: int) -> _StageCost:
        found = self._costs[i].get(n)
        if found is None:
            found = self._costs[i][n] = self._new_cost(i, n)
        return found

    def _new_cost(self, i: int, n: int) -> _StageCost:
        if n <= AFFINE_FROM + 1:
            # stage_params is linear in each stage's layer count: its value at one layer, plus n - 1.
            parts = self._stage(i, n, self._one_layer[i] + (n - 1) * self._per_layer)
        else:
            # Every part is affine in the layer count from AFFINE_FROM layers on.
            a, b = self._cost(i, AFFINE_FROM).parts, self._cost(i, AFFINE_FROM + 1).parts
            parts = tuple(x + (n - AFFINE_FROM) * (y - x) for x, y in zip(a, b, strict=True))
        compute, tp_comm, dp_comm, optimizer, _, memory_gb = parts
        return _StageCost(
            time=max(compute + tp_comm, dp_comm) + optimizer,
            work=compute + tp_comm,
            memory_gb=memory_gb,
            parts=parts,
            microbatch_tokens=self.mb_tokens[i],
        )

    def _stage(self, i: int, n: int, p: int) -> tuple[float, float, float, float, float, float]:
        """Stage i holding n layers (p parameters): compute, TP traffic, DP traffic, optimizer seconds per step
        and the forward-only passes' share of compute and TP traffic, and GB per GPU."""
        model, rl = self.workload.model, self.workload.rl
        s, pool, eff = self.stages[i], self.pools[i], self.effs[i]
        pp = len(self.stages)
        last = i == pp - 1
        recompute = int(rl.gradient_checkpointing)
        forward_passes = rl.forward_passes
        dense = n * model.params_per_layer + (model.vocab * model.hidden if last else 0)
        attn_fwd = 4 * self.attended * model.heads * model.dim_per_head * n  # per token
        fwd = 2 * dense + attn_fwd
        # Forward, backward (2x), recompute under checkpointing; plus forward-only log-prob passes.
        passes = 3 + recompute + forward_passes
        compute = (
            self.tokens * passes * fwd / (s.n_gpus * pool.gpu.flops * size_mfu(eff.train_mfu, model.hidden))
        )
        logp = compute * forward_passes / passes

        tp_comm = 0.0
        if s.tp > 1:
            link = gpu_link(pool, self.calibration)
            # 2 all-reduces per layer forward, 2 backward, 2 recompute; per extra forward pass 2.
            all_reduces = 4 + 2 * recompute + 2 * forward_passes
            tp_comm = self.tokens / s.dp * all_reduces * n * model.hidden * 2 * 2 * (s.tp - 1) / s.tp / link
            logp += tp_comm * 2 * forward_passes / all_reduces

        micro, minibatches = self.micro[i], self.minibatches
        megatron = pp > 1 or rl.megatron  # FSDP has no pipeline parallelism
        shard = (
            pool.gpus_per_machine // s.tp if s.hybrid else s.dp
        )  # ranks one copy of the state is sharded over
        dp_comm = 0.0
        if s.dp > 1:
            if s.n_gpus > pool.gpus_per_machine and not s.hybrid:
                # Every TP slice's ring crosses the machine's NIC once: the whole stage's bytes per collective.
                bw, volume = network(self.cluster, pool.name, pool.name), p
            else:
                bw = gpu_link(pool, self.calibration)
                volume = p / s.tp * (shard - 1) / shard
            if megatron:
                # Distributed optimizer: one fp32 gradient reduce-scatter and one bf16 parameter all-gather
                # per optimizer step; parameters stay whole on each rank between steps.
                dp_comm = minibatches * volume * (4 + 2) / bw
            else:
                # FSDP: two bf16 all-gathers and one fp32 reduce-scatter per micro-batch, one all-gather per
                # micro-batch of each forward-only pass, over the shard group (upstream: all dp ranks).
                per_micro = volume * (2 * 2 + 4) / bw
                per_forward = volume * 2 / bw
                dp_comm = minibatches * micro * (per_micro + forward_passes * per_forward)
            if s.hybrid:
                # FSDP2 HSDP with the all-reduce deferred to the last micro-batch (set_requires_all_reduce):
                # once per optimizer step, each machine's fp32 gradient shards all-reduced across the replicas.
                replicas = s.n_gpus // pool.gpus_per_machine
                network_bw = network(self.cluster, pool.name, pool.name)
                dp_comm += minibatches * 2 * (replicas - 1) / replicas * p * 4 / network_bw

        # Every rank steps the optimizer on its shard of the state.
        optimizer = (
            minibatches
            * p
            / (shard * s.tp)
            * OPTIMIZER_BYTES_PER_PARAM
            / (pool.gpu.hbm_bytes_per_s * eff.hbm_fraction)
        )
        state = (megatron_state_bytes if megatron else train_state_bytes)(p, model, n, shard, s.tp)
        mb_tokens = self.mb_tokens[i]
        in_flight = min(pp - i, micro) if pp > 1 else 1  # 1F1B keeps up to pp - i micro-batches' checkpoints
        acts = train_activation_bytes(model, n, mb_tokens, s.tp, last, rl.gradient_checkpointing)
        acts += (in_flight - 1) * mb_tokens * model.hidden * 2 * n
        return compute, tp_comm, dp_comm, optimizer, logp, (state + acts) / GB

    def _step_s(self, time: list[float], work: list[float]) -> float:
        """The step from the stages' times and per-micro-batch works."""
        return max(max(time) + max(work) * self._bubble, self.pp_comm)

    def step_time(self, costs: list[_StageCost]) -> tuple[float, dict[str, float], float]:
        """The step, its parts (the slowest stage's) and that stage's log-prob passes."""
        slowest = max(range(len(costs)), key=lambda i: costs[i].time)
        bubble = max(c.work for c in costs) * self._bubble
        step = self._step_s([c.time for c in costs], [c.work for c in costs])
        compute, tp_comm, dp_comm, optimizer, logp, _ = costs[slowest].parts
        parts = {
            "compute": compute,
            "tp_comm": tp_comm,
            "dp_comm": dp_comm,
            "optimizer": optimizer,
            "pp_comm": self.pp_comm,
            "bubble": bubble,
        }
        return step, parts, logp

    def _room(self, i: int, usable: float, total: int) -> int:
        """The most layers (up to ``total``, the model's) stage i holds within ``usable`` GB per GPU; 0 if not
        one (kept beside the stage's costs)."""
        key = ("room", usable)
        found = self._costs[i].get(key)
        if found is None:
            found = self._costs[i][key] = self._new_room(i, usable, total)
        return found

    def _new_room(self, i: int, usable: float, total: int) -> int:
        """:meth:`_room`: memory grows with layers and is affine from AFFINE_FROM layers on: read off the line,
        then checked on the stage's own costs (the largest count that fits, exactly as a search over every count
        would find)."""
        edge = AFFINE_FROM + 1
        if total <= edge or self._cost(i, edge).memory_gb > usable:
            return max(
                (n for n in range(1, min(total, edge) + 1) if self._cost(i, n).memory_gb <= usable), default=0
            )
        a, b = self._cost(i, AFFINE_FROM).memory_gb, self._cost(i, edge).memory_gb
        n = total if b <= a else max(edge, min(total, AFFINE_FROM + int((usable - a) / (b - a))))
        while n < total and self._cost(i, n + 1).memory_gb <= usable:
            n += 1
        while self._cost(i, n).memory_gb > usable:
            n -= 1
        return n

    def best_split(self, check_memory: bool) -> tuple[int, ...]:
        """Layers per stage: where the stages' times would be equal, then one layer moved at a time from a
        slowest (or overflowing) stage to another while that lowers the memory overflow, then the step, then the
        slower stages' times. Stages of one GPU type may differ: the last one also computes the LM head."""
        pp, total = len(self.stages), self.workload.model.layers
        if pp == 1:
            return (total,)
        usable = [USABLE_HBM_FRACTION * p.gpu.hbm_gb if check_memory else math.inf for p in self.pools]
        # Start where every stage's time, taken as affine in its layers, is equal (at least one layer each).
        slope = [self._cost(i, 3).time - self._cost(i, 2).time for i in range(pp)]
        if min(slope) <= 0:
            layers = [1] * pp
            layers[-1] += total - pp
        else:
            base = [self._cost(i, 2).time - 2 * b for i, b in enumerate(slope)]
            level = (total + sum(a / b for a, b in zip(base, slope, strict=True))) / sum(1 / b for b in slope)
            share = [max(1.0, (level - a) / b) for a, b in zip(base, slope, strict=True)]
            layers = [int(x) for x in share]
            while sum(layers) > total:
                layers[max(range(pp), key=lambda i: layers[i])] -= 1
            for i in sorted(range(pp), key=lambda i: layers[i] - share[i])[: total - sum(layers)]:
                layers[i] += 1

        # Within memory: the most layers each stage holds (memory grows with layers); none fits, no split helps.
        room = [self._room(i, usable[i], total) for i in range(pp)]
        if sum(room) < total or min(room) < 1:
            return tuple(layers)
        # A layer over a stage's room goes to the stage below its room that it slows least (the first such).
        nxt = None  # per stage below its room, its time with one more layer; None for the others

        def time_with_one_more(j: int) -> float | None:
            return self._cost(j, layers[j] + 1).time if layers[j] < room[j] else None

        for i in range(pp):
            while layers[i] > room[i]:
                layers[i] -= 1
                nxt = nxt or [time_with_one_more(j) for j in range(pp)]
                j = min((t, j) for j, t in enumerate(nxt) if t is not None)[1]
                layers[j] += 1
                nxt[j] = time_with_one_more(j)

        def head(over: list[float], time: list[float], work: list[float]) -> tuple[float, float]:
            return (round(sum(over), 9), self._step_s(time, work))

        # A split's key is (overflow, step, the stages' times slowest first); the times are sorted only where the
        # first two tie. A trial moves one layer from stage a to stage b: two stages' costs change.
        split = tuple(layers)
        costs = self.stage_costs(split)
        over = [max(0.0, c.memory_gb - u) for c, u in zip(costs, usable, strict=True)]
        time, work = [c.time for c in costs], [c.work for c in costs]
        best = head(over, time, work)
        while True:
            slowest = max(time)
            sources = [a for a, c in enumerate(costs) if c.time == slowest or c.memory_gb > usable[a]]
            trials = []
            for a in sources:
                if split[a] <= 1:
                    continue
                shrunk = self._cost(a, split[a] - 1)
                for b in range(pp):
                    if a != b:
                        grown = self._cost(b, split[b] + 1)
                        o, t, w = list(over), list(time), list(work)
                        o[a], t[a], w[a] = max(0.0, shrunk.memory_gb - usable[a]), shrunk.time, shrunk.work
                        o[b], t[b], w[b] = max(0.0, grown.memory_gb - usable[b]), grown.time, grown.work
                        trials.append((head(o, t, w), a, b, o, t, w))
            if not trials:
                return split
            low = min(x[0] for x in trials)
            if low > best:
                return split
            key, moved, a, b, o, t, w = min(
                (
                    (h, sorted(t, reverse=True)),
                    tuple(n + (j == b) - (j == a) for j, n in enumerate(split)),
                    a,
                    b,
                    o,
                    t,
                    w,
                )
                for h, a, b, o, t, w in trials
                if h == low
            )
            if low == best and key[1] >= sorted(time, reverse=True):
                return split
            best, split, over, time, work = low, moved, o, t, w
            costs = list(costs)
            costs[a], costs[b] = self._cost(a, split[a]), self._cost(b, split[b])
