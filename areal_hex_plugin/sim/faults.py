"""Machines lost and gained, and output lengths that drift, replayed in the simulator (``simulate --faults``).

A faults file is YAML: a list ``faults`` of timed events, each with ``at_s`` (seconds from the start of the run)
and one of ``lost: HOST``, ``back: HOST`` (a lost rollout machine returns), ``gained: POOL`` (one more machine of
a pool that generates, in the layout of the pool's first replica group) or ``length_scale: K`` (the output lengths
drawn from then on are the recipe's times K, capped at ``max_new_tokens``). Each is played as the live run plays
it (``areal/elastic/``, ``planner/reshare.py``):

- **lost rollout machine**: its replicas stop at once; ``hex.elastic``'s detection deadline later they leave the
  routing, every sample in flight or queued on them goes to the survivors (counted once per loss as resubmitted),
  and the shares are re-solved over the live servers by the planner's rollout model;
- **back / gained**: the machine's replicas take the current weights (one weight sync), then join the routing with
  the shares re-solved;
- **lost training machine**: the run stops; ``recovery_s`` later (the event's, else its pool's) a replacement
  trains and the run resumes from the last recover checkpoint (``recover.mode`` on or auto, every
  ``recover.freq_steps`` steps or ``freq_secs`` seconds; none: from the start): the steps after it are lost
  (counted) and every rollout in flight is dropped, as a restarted upstream run drops them;
- **drift**: after every step, the output lengths the step drew are scored against the lengths the shares were
  solved for (``reshare.drift``); past ``hex.elastic.drift_threshold`` the shares are re-solved at them.

The same plan and seed are also played without the events, for the tokens/s each step would have had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.reshare import ServerShape, drift, reshare
from areal_hex_plugin.sim.engine import _CALL, _Loop, _Replica, default_warmup
from areal_hex_plugin.sim.fault_file import Fault, read_faults
from areal_hex_plugin.sim.result import SimResult
from areal_hex_plugin.sim.spec import SimSpec
from areal_hex_plugin.sim.staleness import AdmissionControl


@dataclass(frozen=True)
class Setting:
    """What the fault loop needs besides the simulation spec: the live run's rules and the recipe's figures."""

    cm: CostModel
    shapes: tuple[ServerShape, ...]  # per replica group
    detect_s: float
    drift_threshold: float
    drift_min_samples: int
    drift_samples: int  # a window's samples: drift is scored on their rollout time (``reshare.drift``)
    window: int  # the plan's update window: re-shares score the plan's runtime
    max_new_tokens: int
    checkpoint_steps: int | None
    checkpoint_s: float | None


def setting_of(recipe, plan: HexPlan) -> Setting:
    elastic, up = recipe.hex.elastic, recipe.upstream
    recover = up["recover.mode"] in ("on", "auto")
    return Setting(
        cm=CostModel(recipe.cluster, recipe.workload, recipe.calibration),
        shapes=tuple(ServerShape(g.pool, g.tp, g.pp, g.concurrency) for g in plan.rollout.replicas),
        detect_s=elastic.failures_to_down * (elastic.health_interval_s + elastic.health_timeout_s),
        drift_threshold=elastic.drift_threshold,
        drift_min_samples=elastic.drift_min_samples,
        drift_samples=recipe.workload.rl.samples_per_step * plan.solver.window_steps,
        window=plan.solver.window_steps,
        max_new_tokens=recipe.workload.rl.max_new_tokens,
        checkpoint_steps=up["recover.freq_steps"] if recover else None,
        checkpoint_s=up["recover.freq_secs"] if recover else None,
    )


@dataclass
class Outcome:
    """One run with events: the simulation and what the events did."""

    result: SimResult
    resubmitted: int  # samples sent again after their server was lost (once per loss)
    steps_lost: int  # training steps redone after a resume from a checkpoint
    stall_s: float  # seconds the run stood still waiting for a training machine
    reshares: int  # share re-solves after a loss or a join
    rebalances: int  # drift re-balances
    live: list[int]  # live replicas at the end of each step
    notes: list[list[str]]  # what happened during each step
    applied: list[Fault] = field(default_factory=list)  # the events that happened before the run ended


class FaultLoop(_Loop):
    """The simulator's loop with timed machine losses, returns and length drift (see the module's docstring)."""

    def __init__(
        self, spec: SimSpec, seed: int, timeline: bool, faults: list[Fault], setting: Setting
    ) -> None:
        super().__init__(spec, seed, timeline)
        self.setting = setting
        self.cm = setting.cm  # the lengths the shares were solved for
        self.record_timeline = timeline
        self.shape_of = [setting.shapes[r.lane] for r in self.replicas]
        self.scale = 1.0
        self.drawn: list[int] = []
        self.parked: list[tuple[int, int]] = []  # samples waiting for any live server
        self.resubmitted = self.steps_lost = self.reshares = self.rebalances = 0
        self.stall_s = 0.0
        self.stopped_at: float | None = None
        self.resume_token = 0
        self.checkpoint, self.checkpoint_time = 0, 0.0
        self.live_per_step: list[int] = []
        self.notes: list[list[str]] = []
        self.pending: list[str] = []
        self.applied: list[Fault] = []
        for fault in faults:
            self.at(fault.at_s, lambda f=fault: self.apply(f))

    def at(self, time: float, call) -> None:
        self.calls.append(call)
        self.push(time, _CALL, len(self.calls) - 1)

    def outcome(self, steps: int, warmup: int) -> Outcome:
        result = self.run(steps, warmup)
        return Outcome(
            result,
            self.resubmitted,
            self.steps_lost,
            self.stall_s,
            self.reshares,
            self.rebalances,
            self.live_per_step[: len(result.steps)],
            self.notes[: len(result.steps)],
            self.applied,
        )

    # -- events ----------------------------------------------------------------------------------------------
    def apply(self, fault: Fault) -> None:
        self.applied.append(fault)
        self.pending.append(f"{fault.kind} {fault.target} at {self.now:.0f}s")
        if fault.kind == "length_scale":
            self.scale = fault.scale
            return
        if fault.kind == "gained":
            lane = fault.replicas[0]
            replica = _Replica(len(self.replicas), lane, self.spec.lanes[lane], self.record_timeline)
            replica.down = replica.paused = True
            self.replicas.append(replica)
            self.lanes[lane].append(replica)
            self.shape_of.append(self.setting.shapes[lane])
            fault = Fault(fault.at_s, "gained", fault.target, (replica.index,))
        if fault.kind in ("back", "gained"):
            # It takes the current weights over the relay (one weight update) before it serves.
            self.at(self.now + self.spec.sync_s, lambda: self.join(fault.replicas))
            return
        for index in fault.replicas:
            replica = self.replicas[index]
            replica.advance(self.now)
            replica.paused = replica.down = True
            replica.token += 1
        if fault.replicas:
            self.at(self.now + self.setting.detect_s, lambda: self.detect(fault.replicas))
        if fault.trains:
            self.trainer_lost(fault.recovery_s)

    def detect(self, indices: tuple[int, ...]) -> None:
        """The health check marks the lost servers down: out of the routing, their samples to the survivors."""
        samples: list[tuple[int, int]] = []
        for index in indices:
            replica = self.replicas[index]
            if not replica.down:
                continue  # back before it was noticed
            group = self.routing[replica.lane]
            if replica in group:
                group.remove(replica)
            samples += [(round(end - start), rollout) for end, rollout, start in replica.running]
            samples += list(replica.waiting)
            replica.running, replica.start_sum = [], 0.0
            replica.waiting.clear()
            replica.prompts.clear()
        self.resubmitted += len(samples)
        self.reshare()
        self.resubmit(samples)

    def join(self, indices: tuple[int, ...]) -> None:
        for index in indices:
            replica = self.replicas[index]
            replica.down = False
            replica.paused = self.syncing  # a weight update or a stopped run resumes it
            replica.time = replica.stall_until = self.now
            replica.token += 1
            if replica not in self.routing[replica.lane]:
                self.routing[replica.lane].append(replica)
        self.reshare()
        parked, self.parked = self.parked, []
        self.resubmit(parked)
        self.admit()

    def reshare(self) -> None:
        """Shares over the live servers by the planner's rollout model, summed per replica group."""
        live = [not r.down for r in self.replicas]
        self.reshares += 1
        if any(live):
            s = self.setting
            self.route(reshare(self.cm, self.shape_of, live, window=s.window).shares)

    def route(self, shares) -> None:
        self.shares = [0.0] * len(self.lanes)
        for replica, share in zip(self.replicas, shares, strict=True):
            self.shares[replica.lane] += share
        self.share_total = sum(self.shares)
        self.credit = [0.0] * len(self.lanes)

    def resubmit(self, samples: list[tuple[int, int]]) -> None:
        if not any(self.routing):
            self.parked += samples
            return
        touched: dict[tuple[int, int], _Replica] = {}
        for length, rollout in samples:
            replica = self.pick_replica()
            self.routed[replica.lane] -= 1  # a sample sent again is no new rollout
            replica.advance(self.now)
            if rollout not in replica.prompts and (replica.index, rollout) not in touched:
                replica.stall_until = (
                    max(replica.stall_until, self.now) + self.spec.prompt_tokens * replica.prefill_s_per_token
                )
            touched[(replica.index, rollout)] = replica
            replica.waiting.append((length, rollout))
        for replica in {id(r): r for r in touched.values()}.values():
            self.start_waiting(replica)
            self.reschedule(replica)

    def admit(self) -> None:
        if any(self.routing):
            super().admit()

    def draw(self) -> list[int]:
        lengths = super().draw()
        if self.scale != 1.0:
            cap = self.setting.max_new_tokens
            lengths = [min(cap, max(1, round(n * self.scale))) for n in lengths]
        self.drawn += lengths
        return lengths

    # -- training machine lost ---------------------------------------------------------------------------------
    def trainer_lost(self, recovery_s: float) -> None:
        """The run stops until a replacement trains, then resumes from the last checkpoint."""
        if self.stopped_at is None:
            self.stopped_at = self.now
            self.epoch += 1  # the step in progress never ends
            self.training = False
            self.syncing = True  # nothing is admitted, nothing trains
            for replica in self.replicas:
                replica.advance(self.now)
                replica.paused = True
                replica.token += 1
        self.resume_token += 1
        token = self.resume_token
        self.at(self.now + recovery_s, lambda: self.resume(token))

    def resume(self, token: int) -> None:
        if token != self.resume_token:
            return  # a later loss pushed the restart back
        self.stall_s += self.now - self.stopped_at
        self.record_trainer(self.stopped_at, self.now, "stall")
        self.stopped_at = None
        back = self.checkpoint
        lost = self.version - back
        self.steps_lost += lost
        self.pending = [n for notes in self.notes[back:] for n in notes] + self.pending
        self.pending.append(f"resumed from the checkpoint of step {back} (steps lost: {lost})")
        del self.steps[back:], self.notes[back:], self.live_per_step[back:]
        self.version = self.weights = back
        self.step_start = self.steps[-1].end_s if self.steps else 0.0
        self.ready = []
        spec = self.spec
        self.admission = AdmissionControl(
            spec.max_concurrent_rollouts, spec.consumer_batch or spec.batch, spec.max_staleness
        )
        self.admission.accepted = back * (spec.consumer_batch or spec.batch)
        self.parked = []
        for replica in self.replicas:
            replica.running, replica.start_sum = [], 0.0
            replica.waiting.clear()
            replica.prompts.clear()
            replica.time = replica.stall_until = self.now
            replica.paused = replica.down
            replica.token += 1
        self.syncing = False
        self.admit()
        self.start_training()

    # -- every step ---------------------------------------------------------------------------------------
    def end_step(self, sync_s: float) -> None:
        super().end_step(sync_s)
        self.notes.append(self.pending)
        self.pending = []
        self.live_per_step.append(sum(not r.down for r in self.replicas))
        s = self.setting
        due_steps = s.checkpoint_steps and self.version % s.checkpoint_steps == 0
        due_time = s.checkpoint_s and self.now - self.checkpoint_time >= s.checkpoint_s
        if due_steps or due_time:
            self.checkpoint, self.checkpoint_time = self.version, self.now
        drawn, self.drawn = self.drawn, []
        live = [not r.down for r in self.replicas]
        if len(drawn) >= s.drift_min_samples and any(live):
            found = drift(
                self.cm,
                self.shape_of,
                live,
                drawn,
                f"drawn in step {self.version}",
                s.drift_samples,
                s.window,
            )
            if abs(found.change) > s.drift_threshold:
                self.cm = found.measured
                self.route(found.shares)
                self.rebalances += 1
                self.notes[-1].append(f"drift {found.change:+.0%}: shares re-balanced")

    def stalled(self) -> HexError:
        if not any(self.routing):
            return HexError(
                "--faults",
                f"every rollout machine is lost by {self.now:.0f}s and none comes back: the run cannot finish",
                "add a back or gained event, or simulate fewer steps",
            )
        return super().stalled()


def play(
    spec: SimSpec, faults: list[Fault], setting: Setting, steps: int, seed: int = 0, timeline: bool = False
) -> Outcome:
    """Run ``steps`` training steps with ``faults``."""
    return FaultLoop(spec, seed, timeline, faults, setting).outcome(steps, default_warmup(steps))


@dataclass
class FaultReport:
    """The run with the events beside the same run without them."""

    faults_file: str
    hit: Outcome
    clean: Outcome

    def per_step(self) -> list[dict[str, Any]]:
        rows = []
        for k, step in enumerate(self.hit.result.steps):
            clean = self.clean.result.steps[k]
            rows.append(
                {
                    "step": k + 1,
                    "start_s": step.start_s,
                    "end_s": step.end_s,
                    "step_s": step.step_s,
                    "tokens": step.tokens,
                    "tokens_per_s": step.tokens / step.step_s,
                    "tokens_per_s_without_faults": clean.tokens / clean.step_s,
                    "live_replicas": self.hit.live[k],
                    "events": self.hit.notes[k],
                }
            )
        return rows

    def to_dict(self) -> dict[str, Any]:
        hit, clean = self.hit.result, self.clean.result
        return {
            "file": self.faults_file,
            "tokens_per_s": hit.tokens_per_s,
            "tokens_per_s_without_faults": clean.tokens_per_s,
            "tokens_per_s_all_steps": hit.tokens_per_s_all_steps,
            "tokens_per_s_all_steps_without_faults": clean.tokens_per_s_all_steps,
            "samples_resubmitted": self.hit.resubmitted,
            "steps_lost": self.hit.steps_lost,
            "stall_s": self.hit.stall_s,
            "reshares": self.hit.reshares,
            "drift_rebalances": self.hit.rebalances,
            "drift_rebalances_without_faults": self.clean.rebalances,
            "events": [{"at_s": f.at_s, "kind": f.kind, "target": f.target} for f in self.hit.applied],
            "per_step": self.per_step(),
        }


def simulate_faults(
    recipe, plan: HexPlan, spec: SimSpec, faults_file: str, steps: int, seed: int = 0, timeline: bool = False
) -> FaultReport:
    """``simulate --faults``: the plan with the file's events, and without them (same seed)."""
    faults = read_faults(faults_file, recipe, plan)
    setting = setting_of(recipe, plan)
    hit = play(spec, faults, setting, steps, seed, timeline)
    clean = play(spec, [], setting, steps, seed)
    return FaultReport(faults_file, hit, clean)


def describe_faults(report: FaultReport, stream=None) -> str:
    """Console text: the per-step timeline with and without the events, and the totals."""
    from areal_hex_plugin.tables import render_table

    rows = [
        [
            str(r["step"]),
            f"{r['end_s']:,.0f}",
            f"{r['step_s']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s_without_faults']:,.0f}",
            str(r["live_replicas"]),
            "; ".join(r["events"]),
        ]
        for r in report.per_step()
    ]
    d = report.to_dict()
    headers = ["step", "ends (s)", "step (s)", "tokens/s", "without faults", "live replicas", "events"]
    table = render_table(headers, rows, right=headers[:6], stream=stream)
    change = d["tokens_per_s_all_steps"] / d["tokens_per_s_all_steps_without_faults"] - 1
    return "\n".join(
        [
            f"faults of {report.faults_file}: {len(d['events'])} events played",
            table,
            "",
            f"tokens/s over every step: {d['tokens_per_s_all_steps']:,.0f} with the faults, "
            f"{d['tokens_per_s_all_steps_without_faults']:,.0f} without ({change:+.1%}); steady state "
            f"{d['tokens_per_s']:,.0f} against {d['tokens_per_s_without_faults']:,.0f}",
            f"samples resubmitted: {d['samples_resubmitted']:,}; training steps lost: {d['steps_lost']}; stalled "
            f"{d['stall_s']:,.0f}s; shares re-solved {d['reshares']} times, re-balanced for drift "
            f"{d['drift_rebalances']} times",
        ]
    )
