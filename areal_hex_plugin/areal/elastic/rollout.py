"""Elastic rollout: servers lost, gained and re-laid out while a run goes on, and output lengths that drift.

One :class:`ElasticRollout` per training rollout controller (``HexRolloutController``), in the driver's process,
made of three parts each with a module of its own: the servers' health (``health.py``), their shares
(``shares.py``) and length drift (``drift.py``); here, what ties them to the run:

- **Health.** A thread probes every server's ``/health`` every ``hex.elastic.health_interval_s`` (unanswered after
  ``health_timeout_s``: failed); ``failures_to_down`` failures in a row mark it lost, so a server leaves the routing
  at most ``deadline_s = failures_to_down * (interval + timeout)`` seconds after it stops answering. A request that
  fails probes its server at once.
- **Lost.** Its share drops to 0 and the shares are re-solved over the servers left by the planner's rollout model
  (``planner/reshare.py``: milliseconds, no re-plan) and applied to the router in place. The controller
  resubmits every sample in flight on it to the survivors (:meth:`ElasticRollout.submit`): the attempt on the lost
  server is cancelled (or its failure held back from upstream's staleness manager), the sample goes out again under
  a new task id, and only its last attempt is accepted or rejected, so each sample counts once. Every rollout
  worker admits the whole controller's budget (``HexRemoteSGLangEngine.initialize``), so the workers left can make
  a step's samples on their own; the controller's limits still bound the total. Weight updates leave it out: the
  relay route is rebuilt without it before the next update, and a server lost during an update (its commit failed
  and it no longer answers) leaves that version's commit set instead of failing it.
- **Gained.** With ``relaunch`` and a worker that still answers, its server is started again on its machine. It
  joins the relay route at the next update and the routing only once it reports the version the trainer
  committed, so it never serves weights the trainer did not commit; its planned share is then re-solved in.
- **Joined.** ``areal-hex join`` appends a request to ``hex_join.jsonl`` beside the run's plan (``joins.py``);
  the watcher reads it at its next probe round and starts the machine's servers through the run's scheduler
  (``areal/join.py``: hex_local). They are added with share 0 and join the relay route at the next update; each
  takes requests once it reports the version the trainer committed, and the shares are then re-solved for the
  larger fleet. A join that fails is recorded as lost; requests written before the run started are set aside.
- **Re-laid out.** A live re-layout (``relayout.py``, a refit's re-plan) drains a machine's servers (share 0;
  they finish what they hold), retires them (stopped on purpose: never probed, called or relaunched again; what
  they still hold goes out again) and starts its new servers as a joining machine's.
- **Drift.** Each step's served output lengths (the trajectories' loss masks) are scored against the lengths the
  shares were solved for: when they move the predicted rollout time by more than ``drift_threshold``, the shares are
  re-solved with the measured lengths, and a re-plan suggestion is logged: the planner's plan for the measured
  lengths (solved off the training thread), the machines it would move and its predicted gain, with the lengths
  written out for ``hex.workload.output_lengths: {kind: file}``.

Every change is appended to the plan's ``changes`` (``hex_plan.json`` beside upstream's config) and shows in
``hex/elastic/*`` through upstream's StatsLogger.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from areal.utils import logging

from areal_hex_plugin.areal.elastic.drift import DriftAdvisor
from areal_hex_plugin.areal.elastic.health import (
    DRAINING,
    GONE,
    JOINING,
    RETIRED,
    UP,
    ServerHealth,
    http_probe,
)
from areal_hex_plugin.areal.elastic.shares import SharePolicy
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.joins import JOIN_FILE, JoinRequest, read_requests, tag
from areal_hex_plugin.plan import PlanChange
from areal_hex_plugin.planner.reshare import RESOLUTION, ServerShape
from areal_hex_plugin.specs.config import ElasticConfig

logger = logging.getLogger("HexElastic")

# How often a waiting sample looks whether its server was lost.
POLL_S = 0.1
# What started a server a live re-layout started (``relayout.py``).
RELAYOUT = "relayout"

# Per attempt of one sample: the servers it picked, and the verdicts upstream gave it (held back until final).
_attempt_picks: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("hex_attempt", default=None)
_held_verdicts: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "hex_verdicts", default=None
)


def served_version(address: str, timeout_s: float) -> str | None:
    """The weight version the server at ``host:port`` reports (SGLang's ``/get_weight_version``), None if none."""
    import requests

    try:
        answer = requests.get(f"http://{address}/get_weight_version", timeout=timeout_s)
        return str(answer.json().get("weight_version")) if answer.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def output_lengths(trajectory: Any) -> list[int]:
    """Generated tokens per sequence of a trajectory (its loss mask's ones per row); [] when it has none.

    In the controller a trajectory's tensors are upstream's RTensors (shapes only; the data stays on the rollout
    worker): the loss mask alone is fetched, past the fetch buffer the trainer's own reads go through."""
    mask = trajectory.get("loss_mask") if isinstance(trajectory, dict) else None
    if hasattr(mask, "shard") and getattr(mask.data, "is_meta", False):
        from areal.infra.rpc.rtensor import get_backend

        try:
            mask = get_backend().fetch([mask.shard])[0]
        except Exception as error:  # a lost worker: the lengths of this one sample stay unmeasured
            logger.warning(f"cannot read a trajectory's loss mask ({error}); its lengths are not measured")
            return []
    if mask is None or not hasattr(mask, "sum"):
        return []
    return [int(n) for n in mask.sum(-1).reshape(-1).tolist()]


class _HeldVerdicts:
    """Upstream's staleness manager, except that a rejection inside a resubmittable attempt is held back."""

    def __init__(self, inner, held: list[str]) -> None:
        self._inner, self._held = inner, held

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def on_rollout_rejected(self) -> None:
        self._held.append("rejected")


class ElasticRollout:
    """Resubmission, joins and change records for one rollout controller, over its servers' health, shares and
    drift (each a part of its own)."""

    def __init__(
        self,
        config: ElasticConfig,
        cost_model,
        shapes: Sequence[ServerShape],
        names: Sequence[str],
        addresses: Sequence[str],
        *,
        set_shares: Callable[[Sequence[float]], None],
        in_flight: Callable[[int], int],
        staleness: Callable[[], Any],
        record: Callable[[PlanChange], None] = lambda change: None,
        relaunch: Callable[[int], str] | None = None,
        join: Callable[[JoinRequest, set[str]], Any] | None = None,
        joins_file: str | None = None,
        suggest: Callable[[Any], Any] | None = None,
        reroute: Callable[[Sequence[bool]], None] | None = None,
        lengths_file: str | None = None,
        drift_samples: int = RESOLUTION,
        window: int = 1,
        probe: Callable[[str, float], bool] = http_probe,
        version_of: Callable[[str, float], str | None] = served_version,
        end_run: Callable[[HexError], None] | None = None,
        stall_s: float | None = None,
    ) -> None:
        self.config = config
        self.health = ServerHealth(config, addresses, probe)
        self.policy = SharePolicy(cost_model, shapes, set_shares, window)
        self.advisor = DriftAdvisor(
            config.drift_threshold, config.drift_min_samples, drift_samples, window, lengths_file, suggest
        )
        self.names = list(names)
        self.counts: Counter[str] = Counter()
        self.detections: list[dict[str, Any]] = []  # each loss: rank, its first failed probe, when marked
        self.version = 0
        self.step = 0
        self._in_flight, self._record = in_flight, record
        self._staleness = staleness  # upstream's StalenessManager of the controller
        self._relaunch, self._reroute = relaunch, reroute
        self._join, self._joins_file = join, joins_file  # join(request, busy hosts) -> areal.join.Joined
        self._joins_read = 0
        # rank -> what started it mid-run: a join request's index, or RELAYOUT (relayout.py)
        self._started_by: dict[int, int | str] = {}
        self._retiring: set[int] = set()  # ranks a live re-layout drains and stops: never relaunched
        self._joiner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hex-join")  # one join at a time
        self._version_of = version_of
        self._lengths: list[int] = []
        self._accepted: set[int] = set()  # samples (first task ids) accepted
        self._route_dirty = False
        # The last serving server, kept while it fails (:meth:`_keeps_last`): since when; and each server's last
        # accepted sample (monotonic seconds).
        self._kept: dict[int, float] = {}
        self._served_at: dict[int, float] = {}
        self.stall_s = max(60.0, 10 * self.health.deadline_s) if stall_s is None else stall_s
        self._end_run, self._ended = end_run, False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(
            max_workers=min(16, max(1, len(shapes))), thread_name_prefix="hex-health"
        )

    @property
    def states(self) -> list[str]:
        return self.health.states

    @states.setter
    def states(self, states: list[str]) -> None:
        self.health.states = states

    @property
    def shares(self) -> tuple[float, ...]:
        return self.policy.shares

    @shares.setter
    def shares(self, shares: Sequence[float]) -> None:
        self.policy.shares = tuple(shares)

    @property
    def deadline_s(self) -> float:
        """At most this long from a server's last answer to its leaving the routing."""
        return self.health.deadline_s

    @property
    def suggested_gain(self) -> float | None:
        return self.advisor.suggested_gain

    def summary(self) -> dict[str, int]:
        """What happened to the samples and servers so far."""
        keys = (
            "accepted",
            "rejected",
            "resubmitted",
            "in_flight_at_loss",
            "duplicates",
            "lost",
            "relaunched",
        )
        counts = {**self.counts, "reshares": self.policy.reshares}
        return {
            key: counts.get(key, 0) for key in (*keys, "gained", "joined", "retired", "reshares", "changes")
        }

    # -- life --------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._join is not None and self._joins_file and Path(self._joins_file).exists():
            aside = f"{self._joins_file}.before-{int(time.time())}"
            Path(self._joins_file).rename(aside)  # requests for an earlier run in this folder
            logger.warning(f"join requests written before this run started set aside in {aside}")
        self._thread = threading.Thread(target=self._watch, name="hex-elastic", daemon=True)
        self._thread.start()
        logger.info(
            f"watching {len(self.names)} rollout servers: a lost one leaves the routing within "
            f"{self.deadline_s:.1f} s"
        )

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        logger.info(f"hex elastic summary: {json.dumps(self.summary())}")
        if self._thread is not None:
            self._thread.join(timeout=self.deadline_s + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._joiner.shutdown(wait=False, cancel_futures=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            self._take_joins()
            ranks = self.health.to_probe()
            for rank, ok in zip(ranks, self._pool.map(self.health.probe, ranks), strict=True):
                self._after_probe(rank, ok)

    def _after_probe(self, rank: int, ok: bool) -> bool:
        """Count one probe of ``rank``; whether it marked the server down."""
        with self._lock:
            if ok:
                self._kept.pop(rank, None)
            if self.health.record(rank, ok):
                return self.mark_down(rank, f"{self.health.failures[rank]} health probes failed")
            return False

    def confirm_failure(self, rank: int) -> bool:
        """A request on ``rank`` failed: probe it now; whether it is (now) lost. The answer is the marking's, not
        the state read afterwards: a relaunch started by the marking may already have brought the rank back."""
        if self.states[rank] in GONE:
            return True
        if self.health.probe(rank):
            return False
        if self._after_probe(rank, False):
            return True
        # One more probe decides at once rather than at the next round.
        if self.states[rank] in GONE:
            return True
        return not self.health.probe(rank) and self.mark_down(
            rank, "a request failed and its server does not answer"
        )

    def lost_among(self, ranks: Sequence[int]) -> int:
        """Of these servers (a weight update failed to commit on them), how many are lost, each probed now."""
        return sum(self.confirm_failure(rank) for rank in ranks)

    # -- states ------------------------------------------------------------------------------------------

    def live(self) -> list[bool]:
        """Which servers take requests."""
        return self.health.live()

    def reachable(self, rank: int) -> bool:
        """Whether ``rank``'s worker and server take control calls (pause, version, stats): not lost or retired."""
        return self.states[rank] not in GONE

    def mark_down(self, rank: int, reason: str) -> bool:
        """Take ``rank`` out of the routing (and relaunch it where configured); whether it is down now, False
        where it is the last one serving and stays (:meth:`_keeps_last`)."""
        with self._lock:
            if self.states[rank] in GONE:
                return True
            if self._keeps_last(rank, reason):
                return False
            was_serving = self.states[rank] == UP
            before = self.policy.tokens_per_s(self.live())
            detection = self.health.mark_down(rank)
            in_flight = self._in_flight(rank) if was_serving else 0
            self.counts["lost"] += 1
            self.counts["in_flight_at_loss"] += in_flight
            self.detections.append(
                {
                    "rank": rank,
                    "first_failure": detection.first_failure,
                    "marked": detection.marked,
                    "in_flight": in_flight,
                }
            )
            self._route_dirty = True
            self.policy.resolve(self.live())
            logger.warning(
                f"rollout server {self.names[rank]} lost ({reason}) at {detection.marked:.3f}, "
                f"{detection.marked - detection.first_failure:.2f} s after its first failed probe: {in_flight} "
                f"samples in flight go to the others; shares now {self._share_text()}"
            )
            self._change("lost", [self.names[rank]], reason, before)
        if self._relaunch is not None and self.config.relaunch and rank not in self._retiring:
            threading.Thread(target=self._bring_back, args=(rank,), name="hex-relaunch", daemon=True).start()
        return True

    def _keeps_last(self, rank: int, reason: str) -> bool:
        """Whether ``rank`` is the last server that serves, kept in the routing whatever its probes say: without it
        nothing generates, and a server relaunched or joining serves only from the trainer's next version, which
        needs rollouts (on a loaded machine a slow server fails probes too). Said once per run of failures; one
        that neither answers nor finishes a sample for ``stall_s`` ends the run (:meth:`_stalled`)."""
        live = self.live()
        if not live[rank] or sum(live) > 1:
            return False
        if rank not in self._kept:
            self._kept[rank] = time.monotonic()
            logger.warning(
                f"rollout server {self.names[rank]} {reason}, but it is the last one serving: it stays in the "
                "routing (nothing else could serve the trainer's version)"
            )
        else:
            self._stalled(rank)
        return True

    def _stalled(self, rank: int) -> None:
        """The kept last server has answered no probe and finished no sample for ``stall_s``: nothing can serve,
        so the run cannot go on; it ends with one message (``end_run``: the driver's; else it is logged)."""
        silent = time.monotonic() - max(self._kept[rank], self._served_at.get(rank, 0.0))
        if silent < self.stall_s or self._ended:
            return
        self._ended = True
        error = HexError(
            "rollout servers",
            f"none can serve: {self.names[rank]}, the last one serving, has answered no health probe and finished "
            f"no sample for {silent:.0f} s, and a server started now would serve only from the trainer's next "
            "weight version, which needs rollouts",
            "bring its machine back (or areal-hex join another), then run the same command again: the run goes on "
            "from its last recover checkpoint",
        )
        logger.error(error.message)
        if self._end_run is not None:
            self._end_run(error)

    def _bring_back(self, rank: int) -> None:
        try:
            address = self._relaunch(rank)
        except Exception as error:  # the machine is gone too: it stays lost
            logger.warning(f"rollout server {self.names[rank]} cannot be relaunched ({error}); it stays out")
            return
        with self._lock:
            self.health.relaunched(rank, address)
            self._route_dirty = True
            self.counts["relaunched"] += 1
        logger.info(
            f"rollout server {self.names[rank]} relaunched at {address}; it joins the routing once it holds the "
            "trainer's next committed version"
        )

    # -- joins -------------------------------------------------------------------------------------------

    def _take_joins(self) -> None:
        """The join requests appended since the last round, each started in turn off the watcher's thread."""
        if self._join is None or not self._joins_file:
            return
        requests, problems = read_requests(self._joins_file, self._joins_read)
        self._joins_read += len(requests) + len(problems)
        for problem in problems:
            logger.warning(problem)
        for request in requests:
            self._joiner.submit(self._join_one, request)

    def _join_one(self, request: JoinRequest) -> None:
        with self._lock:
            busy = {
                name.split("/")[0]
                for name, state in zip(self.names, self.states, strict=True)
                if state not in GONE
            }
        logger.info(f"{tag(request.index)}: {request.host} (pool {request.pool}) joins; starting its servers")
        try:
            joined = self._join(request, busy)
        except Exception as error:  # the machine does not come: recorded, the run goes on
            logger.warning(f"{tag(request.index)} failed: {error}")
            with self._lock:
                before = self.policy.tokens_per_s(self.live())
                self._change("lost", [request.host], f"{tag(request.index)} failed: {error}", before)
            return
        self.add_started(joined, request.index)
        logger.info(
            f"{tag(request.index)}: servers {', '.join(joined.names)} started at {', '.join(joined.addresses)}; "
            "each takes requests once it holds the trainer's next committed version"
        )

    def add_started(self, joined, by: int | str) -> list[int]:
        """Servers started for this run (:class:`~areal_hex_plugin.areal.join.Joined`) ``by`` a join request (its
        index) or a live re-layout (:data:`RELAYOUT`), attached to the controller and the relay: joining, with share
        0, until they hold the trainer's next committed version; their ranks."""
        with self._lock:
            ranks = []
            for shape, name, address in zip(joined.shapes, joined.names, joined.addresses, strict=True):
                self.policy.add(shape)
                self.names.append(name)
                ranks.append(self.health.add(address))
                self._started_by[ranks[-1]] = by
            joined.attach()
            self._route_dirty = True
        return ranks

    # -- live re-layouts (relayout.py) -------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """Whether the run ended (:meth:`stop`)."""
        return self._stop.is_set()

    def in_flight(self, rank: int) -> int:
        """The requests server ``rank`` holds now."""
        return self._in_flight(rank)

    def ranks_on(self, host: str) -> list[int]:
        """The servers on ``host`` that are not lost or retired."""
        return [
            rank
            for rank, name in enumerate(self.names)
            if name.split("/")[0] == host and self.states[rank] not in GONE
        ]

    def capacity(self, without: Sequence[int] = ()) -> float:
        """Predicted tokens/s of the servers that serve, ``without`` these."""
        with self._lock:
            live = self.live()
            for rank in without:
                live[rank] = False
            return self.policy.tokens_per_s(live)

    def drain(self, ranks: Sequence[int]) -> None:
        """``ranks`` take no new requests (share 0, the others' shares re-solved) and finish the ones they hold."""
        with self._lock:
            for rank in ranks:
                self._retiring.add(rank)
                self.states[rank] = DRAINING
            self.policy.resolve(self.live())

    def retire(self, ranks: Sequence[int]) -> int:
        """``ranks`` stopped on purpose: never probed, called or relaunched again; the samples they still hold go
        out again to the others and the relay route leaves them out from the next update. Those samples' count."""
        with self._lock:
            held = sum(self._in_flight(rank) for rank in ranks if self.states[rank] == DRAINING)
            for rank in ranks:
                self._retiring.add(rank)
                self.states[rank] = RETIRED
            self.counts["retired"] += len(ranks)
            self._route_dirty = True
        return held

    def record(self, kind: str, hosts: list[str], reason: str, before: float) -> None:
        """Append a change to the plan's ``changes`` (the shares and tokens/s after it from now)."""
        with self._lock:
            self._change(kind, hosts, reason, before)

    def before_update(self) -> None:
        """Before a weight update: the relay route follows the servers that are not lost (joining ones included,
        so they receive the version)."""
        with self._lock:
            if not self._route_dirty or self._reroute is None:
                return
            self._route_dirty = False
            reachable = [state not in GONE for state in self.states]
        self._reroute(reachable)

    def on_version(self, version: int) -> None:
        """The trainer committed ``version`` to the servers: a joining server that holds it starts serving."""
        self.version = version
        for rank, state in enumerate(self.states):
            if state != JOINING:
                continue
            held = self._version_of(self.health.addresses[rank], self.config.health_timeout_s)
            if held != str(version):
                continue
            with self._lock:
                before = self.policy.tokens_per_s(self.live())
                self.states[rank] = UP
                self.policy.resolve(self.live())
                self.counts["gained"] += 1
                by = self._started_by.get(rank)
                if by == RELAYOUT:
                    how = f"started in its new layout (live re-layout), holds version {version}"
                elif by is None:
                    how = f"relaunched, holds version {version}"
                else:
                    self.counts["joined"] += 1
                    how = f"joined ({tag(by)}), holds version {version}"
                logger.info(
                    f"rollout server {self.names[rank]} serves ({how}); shares now {self._share_text()}"
                )
                self._change("gained", [self.names[rank]], how, before)

    def recalibrate(self, calibration, reason: str, min_gain: float = 0.0) -> bool:
        """An online refit (``areal/refit_loop.py``, ``hex.elastic.auto_replan``): the shares are re-solved under
        ``calibration`` from now on and, where they move and serve more than ``min_gain`` faster, applied and
        recorded; whether they moved."""
        with self._lock:
            before = self.policy.tokens_per_s(self.live())
            moved = self.policy.recalibrate(calibration, self.live(), min_gain)
            if moved:
                self._change("reshare", [], reason, before)
        if moved:
            logger.info(f"{reason}: shares now {self._share_text()}")
        return moved

    # -- records -----------------------------------------------------------------------------------------

    def _share_text(self) -> str:
        return ", ".join(f"{n}: {s:.3f}" for n, s in zip(self.names, self.shares, strict=True))

    def _change(self, kind: str, hosts: list[str], reason: str, before: float) -> None:
        change = PlanChange(
            kind=kind,
            hosts=hosts,
            reason=reason,
            step=self.step,
            tokens_per_s_before=round(before, 3),
            tokens_per_s_after=round(self.policy.tokens_per_s(self.live()), 3),
            shares={n: round(s, 6) for n, s in zip(self.names, self.shares, strict=True)},
        )
        self.counts["changes"] += 1
        self._record(change)

    # -- samples -----------------------------------------------------------------------------------------

    def picked(self, rank: int) -> None:
        """The controller chose ``rank`` for the attempt running in this context."""
        picks = _attempt_picks.get()
        if picks is not None:
            picks.append(rank)

    def manager(self, inner):
        """Upstream's staleness manager as this context's attempt sees it (rejections held back)."""
        held = _held_verdicts.get()
        return inner if held is None or inner is None else _HeldVerdicts(inner, held)

    async def submit(self, task_input, attempt: Callable, new_task_id: Callable[[], int], forget: Callable):
        """Run one sample to its end: ``attempt(task_input)`` (an awaitable of upstream's submit-then-wait that
        releases its server) until it gives a trajectory, or fails on a server that still answers; a sample
        whose server is lost goes out again, to the others, under a new task id (the lost server's late callback
        must not resolve the new attempt). ``forget(task_id)`` drops a cancelled attempt's pending future."""
        resubmits, sample = 0, task_input.task_id
        while True:
            picks: list[int] = []
            held: list[str] = []
            tokens = (_attempt_picks.set(picks), _held_verdicts.set(held))
            try:
                task = asyncio.ensure_future(attempt(task_input))
            finally:
                _held_verdicts.reset(tokens[1])
                _attempt_picks.reset(tokens[0])
            try:
                lost = await self._until_done_or_lost(task, picks)
            except (
                BaseException
            ):  # the sample itself is cancelled (teardown): so is its attempt, in its context
                task.cancel()
                raise
            if lost:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                forget(task_input.task_id)
            else:
                result = task.result()
                if result is not None:
                    lengths = await asyncio.to_thread(output_lengths, result.trajectory)
                    with self._lock:
                        if picks:
                            self._served_at[picks[-1]] = time.monotonic()
                        self.counts["accepted"] += 1
                        self.counts["duplicates"] += sample in self._accepted
                        self._accepted.add(sample)
                        self._lengths.extend(lengths)
                    return result
                lost = bool(picks) and await asyncio.to_thread(self.confirm_failure, picks[-1])
            if not lost or not any(self.live()) or resubmits >= len(self.names):
                for _ in held:  # the sample's last attempt: its verdict goes to upstream's manager
                    self.counts["rejected"] += 1
                    self._staleness().on_rollout_rejected()
                return None
            resubmits += 1
            self.counts["resubmitted"] += 1
            task_input = replace(task_input, task_id=new_task_id())

    async def _until_done_or_lost(self, task: asyncio.Future, picks: list[int]) -> bool:
        while not task.done():
            await asyncio.wait({task}, timeout=POLL_S)
            if not task.done() and picks and self.states[picks[-1]] in GONE:
                return True
        return False

    # -- drift -------------------------------------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        """Once per training step: the drift check, and ``hex/elastic/*``."""
        # One lock with the watcher: a machine that joins grows the servers' lists.
        with self._lock:
            lengths, self._lengths = self._lengths, []
            out = {
                "hex/elastic/live_servers": float(sum(self.live())),
                "hex/elastic/lost": float(self.counts["lost"]),
                "hex/elastic/gained": float(self.counts["gained"]),
                "hex/elastic/joined": float(self.counts["joined"]),
                "hex/elastic/resubmitted": float(self.counts["resubmitted"]),
                "hex/elastic/changes": float(self.counts["changes"]),
            }
            found = self.advisor.check(self.policy.cm, self.policy.shapes, self.live(), lengths, self.step)
            if found is not None:
                out["hex/elastic/served_mean_tokens"] = sum(lengths) / len(lengths)
                if self.advisor.moved():
                    self._rebalance(found, lengths)
            out["hex/elastic/drift"] = self.advisor.change
            if self.suggested_gain is not None:
                out["hex/elastic/replan_gain"] = self.suggested_gain
            out.update({f"hex/elastic/share/{n}": s for n, s in zip(self.names, self.shares, strict=True)})
        stat = getattr(self._staleness(), "rollout_stat", None)
        logger.info(
            f"hex elastic step {self.step} ended at {time.time():.3f}: {json.dumps(self.summary())}; upstream's "
            f"rollouts {stat}"
        )
        self.step += 1
        return out

    def _rebalance(self, found, lengths: list[int]) -> None:
        with self._lock:
            before = self.policy.tokens_per_s(self.live())
            was = self.policy.cm.workload.output_lengths.mean
            self.policy.cm = found.measured
            self.policy.apply(found.shares)
            reason = (
                f"served outputs average {found.measured.workload.output_lengths.mean:.1f} tokens against "
                f"{was:.1f}: the predicted rollout time moves {self.advisor.change:+.0%}"
            )
            self._change("drift", [], reason, before)
        logger.warning(f"length drift: {reason}; shares re-balanced online to {self._share_text()}")
        self.advisor.advise(found, lengths)


def attach_elastic(trainer) -> ElasticRollout | None:
    """Watch the trainer's rollout servers (``hex.elastic``); None when disabled or not a Hex controller."""
    from areal_hex_plugin.areal.engines import HexRolloutController
    from areal_hex_plugin.planner.replan import replan_for_lengths

    config, rollout = trainer.config, trainer.rollout
    if not config.hex.elastic.enabled or not isinstance(rollout, HexRolloutController):
        return None
    session = trainer.hex_session
    recipe = session.recipe
    slots = rollout._slots()
    elastic = ElasticRollout(
        config.hex.elastic,
        session.cost_model(),
        [ServerShape(s.pool, s.tp, s.pp, s.concurrency or None) for s in slots],
        [f"{s.host}/{rank}" for rank, s in enumerate(slots)],
        [f"{info.host}:{info.port}" for info in rollout.server_infos],
        set_shares=trainer.hex_set_shares,
        in_flight=rollout.hex_in_flight,
        staleness=lambda: rollout._staleness_manager,
        record=trainer.hex_record_change,
        relaunch=trainer.hex_relaunch_server if trainer.hex_relaunches() else None,
        join=trainer.hex_join if trainer.hex_relaunches() else None,
        joins_file=trainer.hex_log_path(JOIN_FILE),
        suggest=lambda workload: replan_for_lengths(recipe, trainer.hex_plan, workload),
        reroute=trainer.hex_reroute,
        lengths_file=trainer.hex_log_path("hex_served_lengths.txt"),
        drift_samples=recipe.workload.rl.samples_per_step * trainer.hex_plan.solver.window_steps,
        window=trainer.hex_plan.solver.window_steps,
        end_run=session.end_run,
    )
    elastic.shares = tuple(rollout._router().shares)
    if hasattr(
        trainer.actor, "hex_lost_among"
    ):  # the relay: a server lost during an update leaves its commit set
        trainer.actor.hex_lost_among = elastic.lost_among
    rollout.hex_elastic = elastic
    elastic.start()
    return elastic
