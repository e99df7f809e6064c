"""The event loop: AReaL's asynchronous RL loop on one plan, event by event, deterministic for a seed.

Events are per sequence, never per token: a replica decodes all its running sequences in lock-step, so each
sequence's end is fixed in the replica's *decode-step clock* when it starts (start step + drawn length), and only
the mapping from steps to seconds changes with the number of sequences in flight. The queue holds one pending
event per replica (its next sequence end), plus reward completions and the trainer's own events.

What is modelled, following upstream AReaL 1.0.4 (``PPOTrainer.train``, ``RolloutController``, SGLang):
- the dispatcher submits rollouts while the staleness manager's capacity is positive (``staleness.py``); each
  goes to a replica group by smooth weighted round-robin over the plan's shares, and to the group's replicas in
  turn (upstream's v1 controller sends a whole rollout to one worker and its server); its ``n_samples``
  sequences share one prompt prefill (SGLang's radix cache);
- each sample is scored as soon as it is generated, on ``reward_workers`` parallel workers; a rollout is
  accepted when its last sample is scored;
- the trainer takes the ``batch`` earliest-created accepted rollouts (``WorkflowExecutor.wait_results`` sorts
  by creation time), trains, then pauses generation and submission for the weight update; in-flight sequences
  are interrupted (SGLang aborts them), and on resume their KV caches (prompt + generated tokens) are
  recomputed before they continue under the new version (their head version is unchanged);
- with ``update_interval`` k > 1 (the plan's window, which the driver runs) weights go out after every k-th step
  only; the other steps end without a pause, and admission counts the servers' weights version, which lags the
  trainer by up to k - 1 steps (``HexPPOTrainer`` sets upstream's rollout version the same way).
"""

from __future__ import annotations

import heapq
import random
from collections import deque

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.sim.result import PoolUsage, Segment, SimResult, StepRecord
from areal_hex_plugin.sim.spec import LaneSpec, SimSpec
from areal_hex_plugin.sim.staleness import AdmissionControl

_SEQ_END, _ACCEPT, _TRAIN_DONE, _SYNC_DONE, _CALL = range(5)
_EPS_STEPS = 1e-6  # floating-point slack when comparing decode-step clocks


class _Replica:
    __slots__ = (
        "index",
        "lane",
        "step_table",
        "prefill_s_per_token",
        "max_running",
        "steps",
        "time",
        "stall_until",
        "running",
        "start_sum",
        "prompts",
        "waiting",
        "paused",
        "down",
        "token",
        "busy_s",
        "segments",
    )

    def __init__(self, index: int, lane: int, spec: LaneSpec, record: bool) -> None:
        self.index = index
        self.lane = lane
        self.step_table = (spec.step_s[0], *spec.step_s)  # indexed by sequences running
        self.prefill_s_per_token = 1.0 / spec.prefill_tokens_per_s
        self.max_running = spec.max_running
        self.steps = 0.0  # decode steps done since the start
        self.time = 0.0  # when ``steps`` was last brought up to date
        self.stall_until = 0.0  # prefill/recompute work keeps the replica from decoding until then
        # A heap of (end step, rollout, start step) per running sequence, and the sum of their start steps.
        self.running: list[tuple[float, int, float]] = []
        self.start_sum = 0.0
        # Rollout -> its samples running here (they share one cached prompt).
        self.prompts: dict[int, int] = {}
        self.waiting: deque[tuple[int, int]] = deque()  # (length, rollout)
        self.paused = False
        self.down = False  # lost (sim/faults.py): it neither decodes nor resumes after a weight update
        self.token = 0  # bumps invalidate this replica's pending event
        self.busy_s = 0.0
        self.segments: list[Segment] | None = [] if record else None

    def advance(self, now: float) -> None:
        """Bring the step clock and the busy time up to ``now`` (nothing changes while paused)."""
        then = self.time
        if now <= then:
            return
        self.time = now
        if self.paused:
            return
        n = len(self.running)
        decode_from = self.stall_until if self.stall_until > then else then
        if n and now > decode_from:
            self.steps += (now - decode_from) / self.step_table[n]
        busy_until = now if n else min(now, self.stall_until)
        if busy_until > then:
            self.busy_s += busy_until - then
        if self.segments is not None:
            stall_end = min(now, max(then, self.stall_until))
            self.record(then, stall_end, "prefill")
            self.record(stall_end, now, "decode" if n else "idle")

    def record(self, start: float, end: float, state: str) -> None:
        if end <= start:
            return
        segments = self.segments
        if segments and segments[-1].state == state and segments[-1].end_s == start:
            segments[-1] = Segment(segments[-1].start_s, end, state)
        else:
            segments.append(Segment(start, end, state))


class _Loop:
    def __init__(self, spec: SimSpec, seed: int, timeline: bool) -> None:
        if not spec.lanes or sum(lane.count for lane in spec.lanes) == 0:
            raise ValueError("a simulation needs at least one rollout replica")
        self.spec = spec
        self.rng = random.Random(seed)
        self.queue: list[tuple] = []
        self.seq = 0  # tie-breaker: equal times pop in insertion order
        self.now = 0.0
        self.events = 0
        self.lanes: list[list[_Replica]] = []
        self.replicas: list[_Replica] = []
        for i, lane in enumerate(spec.lanes):
            group = [_Replica(len(self.replicas) + k, i, lane, timeline) for k in range(lane.count)]
            self.lanes.append(group)
            self.replicas.extend(group)
        self.routing = [list(group) for group in self.lanes]  # the replicas each group routes to
        self.shares = [lane.share if lane.count else 0.0 for lane in spec.lanes]
        self.share_total = sum(self.shares)
        if self.share_total <= 0:
            raise ValueError("replica shares must not all be zero")
        self.credit = [0.0] * len(spec.lanes)
        self.next_instance = [0] * len(spec.lanes)
        self.routed = [0] * len(spec.lanes)
        self.admission = AdmissionControl(
            spec.max_concurrent_rollouts, spec.consumer_batch or spec.batch, spec.max_staleness
        )
        self.version = 0  # the trainer's
        self.weights = 0  # the rollout servers' (admission counts this one)
        self.updates = 0
        # Rollouts, by id: samples not yet scored, when the last was scored, head version, tokens.
        self.remaining: list[int] = []
        self.scored_at: list[float] = []
        self.head_version: list[int] = []
        self.tokens: list[int] = []
        self.ready: list[int] = []  # accepted rollouts by id (= creation order), a heap
        self.reward_free = [0.0] * max(1, spec.reward_workers)
        self.syncing = False
        self.sync_started = 0.0
        self.training = False
        self.step_start = 0.0
        self.batch_ready_at = 0.0
        self.batch_tokens = 0
        self.batch_lags: dict[int, int] = {}
        self.steps: list[StepRecord] = []
        self.staleness: dict[int, int] = {}
        self.interrupted = 0
        self.recompute_s = 0.0  # replica-seconds of KV recompute after weight updates
        self.trainer_segments: list[Segment] | None = [] if timeline else None
        self.epoch = 0  # a restart from a checkpoint (sim/faults.py) bumps it: older trainer events go stale
        self.calls: list = []  # callables that _CALL events run (by index)

    # -- queue ---------------------------------------------------------------------------------------------
    def push(self, time: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (time, self.seq, kind, a, b))

    def reschedule(self, replica: _Replica) -> None:
        """Queue the replica's next sequence end (if nothing changes meanwhile); older ones go stale."""
        replica.token += 1
        running = replica.running
        if replica.paused or not running:
            return
        start = replica.stall_until if replica.stall_until > replica.time else replica.time
        left = running[0][0] - replica.steps
        end = start + (left if left > 0 else 0.0) * replica.step_table[len(running)]
        self.seq += 1
        heapq.heappush(self.queue, (end, self.seq, _SEQ_END, replica.index, replica.token))

    # -- rollout side ----------------------------------------------------------------------------------------
    def pick_replica(self) -> _Replica:
        """Smooth weighted round-robin over groups by share, then the group's replicas in turn."""
        best, best_credit = -1, 0.0
        for i, share in enumerate(self.shares):
            self.credit[i] += share
            if best < 0 or self.credit[i] > best_credit:
                best, best_credit = i, self.credit[i]
        self.credit[best] -= self.share_total
        self.routed[best] += 1
        group = self.routing[best]
        k = self.next_instance[best] % len(group)
        self.next_instance[best] = k + 1
        return group[k]

    def draw(self) -> list[int]:
        """The output lengths of one rollout's samples."""
        return self.rng.choices(self.spec.lengths, k=self.spec.n_samples)

    def submit(self) -> None:
        spec = self.spec
        rollout = len(self.remaining)
        lengths = self.draw()
        self.remaining.append(spec.n_samples)
        self.scored_at.append(0.0)
        self.head_version.append(self.weights)
        self.tokens.append(sum(lengths) + spec.n_samples * spec.prompt_tokens)
        self.admission.on_submitted()
        replica = self.pick_replica()
        replica.advance(self.now)
        # The samples share one prompt: SGLang's radix cache prefills it once.
        replica.stall_until = (
            max(replica.stall_until, self.now) + spec.prompt_tokens * replica.prefill_s_per_token
        )
        for length in lengths:
            replica.waiting.append((length, rollout))
        self.start_waiting(replica)
        self.reschedule(replica)

    def start_waiting(self, replica: _Replica) -> None:
        while replica.waiting and len(replica.running) < replica.max_running:
            length, rollout = replica.waiting.popleft()
            heapq.heappush(replica.running, (replica.steps + length, rollout, replica.steps))
            replica.start_sum += replica.steps
            replica.prompts[rollout] = replica.prompts.get(rollout, 0) + 1

    def on_sequence_end(self, replica: _Replica) -> None:
        replica.advance(self.now)
        running = replica.running
        limit = replica.steps + _EPS_STEPS
        while running and running[0][0] <= limit:
            end, rollout, start = heapq.heappop(running)
            if end > replica.steps:
                replica.steps = end
            replica.start_sum -= start
            left = replica.prompts.pop(rollout) - 1
            if left:
                replica.prompts[rollout] = left
            self.generated(rollout)
        if not running:
            replica.start_sum = 0.0  # drop accumulated rounding
        self.start_waiting(replica)
        self.reschedule(replica)

    def generated(self, rollout: int) -> None:
        """One sample is generated: score it (upstream's episode computes its reward right away); the rollout is
        accepted once its last sample is scored."""
        reward_s = self.spec.reward_s_per_sample
        if reward_s > 0:
            free = heapq.heappop(self.reward_free)
            scored = (free if free > self.now else self.now) + reward_s
            heapq.heappush(self.reward_free, scored)
            if scored > self.scored_at[rollout]:
                self.scored_at[rollout] = scored
        self.remaining[rollout] -= 1
        if self.remaining[rollout]:
            return
        if reward_s > 0:
            self.push(self.scored_at[rollout], _ACCEPT, rollout, self.epoch)
        else:
            self.accept(rollout)

    def accept(self, rollout: int) -> None:
        self.admission.on_accepted()
        heapq.heappush(self.ready, rollout)
        self.admit()
        self.start_training()

    def admit(self) -> None:
        if self.syncing:
            return
        for _ in range(self.admission.capacity(self.weights)):
            self.submit()

    # -- trainer side -----------------------------------------------------------------------------------------
    def start_training(self) -> None:
        spec = self.spec
        if self.training or self.syncing or len(self.ready) < spec.batch:
            return
        self.training = True
        self.batch_ready_at = self.now
        tokens = 0
        lags: dict[int, int] = {}
        for _ in range(spec.batch):
            rollout = heapq.heappop(self.ready)
            tokens += self.tokens[rollout]
            lag = self.version - self.head_version[rollout]
            lags[lag] = lags.get(lag, 0) + spec.n_samples
        self.batch_tokens = tokens
        self.batch_lags = lags
        self.record_trainer(self.step_start, self.now, "wait")
        self.record_trainer(self.now, self.now + spec.train_s, "train")
        self.push(self.now + spec.train_s, _TRAIN_DONE, self.epoch)

    def train_done(self) -> None:
        self.training = False
        if (self.version + 1) % self.spec.update_interval:
            self.end_step(sync_s=0.0)  # no weight update after this step
            self.admit()
            self.start_training()
            return
        self.syncing = True
        self.sync_started = self.now
        for replica in self.replicas:
            replica.advance(self.now)
            replica.paused = True
            replica.token += 1
            self.interrupted += len(replica.running)
            if replica.segments is not None:
                replica.record(self.now, self.now + self.spec.sync_s, "sync")
        self.record_trainer(self.now, self.now + self.spec.sync_s, "sync")
        self.push(self.now + self.spec.sync_s, _SYNC_DONE, self.epoch)

    def end_step(self, sync_s: float) -> None:
        self.version += 1
        self.steps.append(
            StepRecord(
                start_s=self.step_start,
                rollout_wait_s=self.batch_ready_at - self.step_start,
                train_s=self.spec.train_s,
                sync_s=sync_s,
                tokens=self.batch_tokens,
            )
        )
        for lag, samples in self.batch_lags.items():
            self.staleness[lag] = self.staleness.get(lag, 0) + samples
        self.step_start = self.now

    def sync_done(self) -> None:
        spec = self.spec
        self.syncing = False
        self.end_step(spec.sync_s)
        self.weights = self.version
        self.updates += 1
        for replica in self.replicas:
            if replica.down:
                continue
            replica.time = self.now
            replica.paused = False
            n = len(replica.running)
            if n and spec.kv_recompute:
                # Interrupted sequences lost their KV cache: prefill their generated tokens and their prompts
                # (once per rollout: the radix cache shares them) again, including prefill the pause cut short.
                kv_tokens = len(replica.prompts) * spec.prompt_tokens + n * replica.steps - replica.start_sum
                replica.stall_until = self.now + kv_tokens * replica.prefill_s_per_token
                self.recompute_s += kv_tokens * replica.prefill_s_per_token
            else:
                # Prefill work the pause cut short resumes where it stopped.
                replica.stall_until = self.now + max(0.0, replica.stall_until - self.sync_started)
            self.reschedule(replica)
        self.admit()
        self.start_training()

    def record_trainer(self, start: float, end: float, state: str) -> None:
        if self.trainer_segments is not None and end > start:
            self.trainer_segments.append(Segment(start, end, state))

    # -- main loop ------------------------------------------------------------------------------------------
    def run(self, n_steps: int, warmup: int) -> SimResult:
        snapshot: list[float] | None = None
        window_start = 0.0
        self.admit()
        queue = self.queue
        replicas = self.replicas
        while len(self.steps) < n_steps:
            if not queue:
                raise self.stalled()
            time, _, kind, a, b = heapq.heappop(queue)
            self.now = time
            self.events += 1
            if kind == _SEQ_END:
                replica = replicas[a]
                if b == replica.token:
                    self.on_sequence_end(replica)
            elif kind == _ACCEPT:
                if b == self.epoch:
                    self.accept(a)
            elif kind == _CALL:
                self.calls[a]()
            elif a == self.epoch:
                if kind == _TRAIN_DONE:
                    self.train_done()
                else:
                    self.sync_done()
                if warmup and snapshot is None and len(self.steps) == warmup:
                    window_start = self.now
                    snapshot = self.lane_busy()
        end = self.now
        for replica in replicas:
            replica.advance(end)
        busy = self.lane_busy()
        if snapshot is not None:
            busy = [b - s for b, s in zip(busy, snapshot, strict=True)]
        return SimResult(
            steps=self.steps,
            warmup_steps=warmup,
            pools=self.pool_usage(busy, end - window_start, len(self.steps) - warmup),
            staleness=self.staleness,
            interrupted=self.interrupted,
            recompute_s_per_update=self.recompute_s / len(self.replicas) / max(1, self.updates),
            routed={lane.name: n for lane, n in zip(self.spec.lanes, self.routed, strict=True)},
            events=self.events,
            timeline=self.timeline(),
        )

    def stalled(self) -> HexError:
        """Nothing runs and nothing may start: the staleness window holds fewer rollouts than a batch."""
        spec = self.spec
        window = (spec.max_staleness + self.weights + 1) * (spec.consumer_batch or spec.batch)
        return HexError(
            "rollout.consumer_batch_size",
            f"admission stops at {window} rollouts by version {self.weights}, but a training step needs "
            f"{spec.batch} more than the {self.admission.accepted - len(self.ready)} consumed so far: "
            "upstream would wait forever",
            "set rollout.consumer_batch_size to train_dataset.batch_size, or raise max_head_offpolicyness",
        )

    def lane_busy(self) -> list[float]:
        totals = [0.0] * len(self.lanes)
        for replica in self.replicas:
            totals[replica.lane] += replica.busy_s
        return totals

    def pool_usage(self, lane_busy: list[float], window_s: float, window_steps: int) -> dict[str, PoolUsage]:
        spec = self.spec
        synced = sum(s.sync_s for s in self.steps[len(self.steps) - window_steps :]) if window_steps else 0.0
        gpus: dict[str, int] = dict(spec.train_gpus)
        for pool, n in spec.rollout_gpus.items():
            gpus[pool] = gpus.get(pool, 0) + n
        usage: dict[str, PoolUsage] = {}
        for pool, n in sorted(gpus.items()):
            train_gpus = spec.train_gpus.get(pool, 0)
            rollout = sum(
                busy * lane.gpus_per_replica
                for busy, lane in zip(lane_busy, spec.lanes, strict=True)
                if lane.pool == pool
            )
            rollout_gpus = spec.rollout_gpus.get(pool, 0)
            train = train_gpus * spec.train_s * window_steps
            sync = n * synced
            idle = max(0.0, n * window_s - train - rollout - sync)
            rollout_idle = max(0.0, rollout_gpus * (window_s - synced) - rollout)
            usage[pool] = PoolUsage(n, train, rollout, sync, idle, rollout_gpus, rollout_idle)
        return usage

    def timeline(self) -> dict[str, dict[str, list[Segment]]]:
        """Pool -> row -> segments: the trainer (on each training pool) and every rollout replica."""
        if self.trainer_segments is None:
            return {}
        rows: dict[str, dict[str, list[Segment]]] = {}
        for pool in self.spec.train_gpus:
            rows.setdefault(pool, {})["trainer"] = self.trainer_segments
        for lane, replicas in zip(self.spec.lanes, self.lanes, strict=True):
            for k, replica in enumerate(replicas):
                if replica.segments is not None:
                    rows.setdefault(lane.pool, {})[f"{lane.name} #{k}"] = replica.segments
        return rows


def simulate(
    spec: SimSpec, steps: int = 30, seed: int = 0, warmup: int | None = None, timeline: bool = False
) -> SimResult:
    """Run the loop for ``steps`` training steps. The first ``warmup`` steps (default: a fifth, at least one
    when there are two or more) fill the pipeline and are left out of the steady-state figures."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    return _Loop(spec, seed, timeline).run(steps, default_warmup(steps) if warmup is None else warmup)


def default_warmup(steps: int) -> int:
    """The steps that fill the pipeline by default: a fifth, at least one when there are two or more."""
    return min(steps - 1, max(1, steps // 5))
