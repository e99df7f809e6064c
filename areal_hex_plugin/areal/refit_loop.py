"""The online refit beside the trainer (``hex.calibration.refit_every``): plans that learn from the run.

Every training step (upstream's stats commit, on the training thread: cheap) adds what the step measured to a
:class:`~areal_hex_plugin.costmodel.refit.MeasurementWindow`: each rollout server's decode tokens/s at its running
requests (``areal/server_stats.py``; each step also logs every server's figures, :func:`server_figures`), the
train phase (upstream's ``timeperf/recompute_logp``, ``ref_logp`` and ``train_step``: what the model prices as
train time) and, on a step that pushed weights, ``timeperf/update_weights``. Every ``refit_every`` steps the
window's medians go to the run's refit worker, a process of its own at lowered priority that imports only the
core (``planner/refit_worker.py``: never a training step, nor the trainer's process and its GIL); a thread of this
process waits for its answer, then:

1. the refit of the factors of the GPU types in play (``costmodel/refit.py``; the recipe's calibration the prior)
   is logged as wandb ``hex/calibration/<type>/<factor>`` and each point's residual, and written to
   ``hex_profile.json`` beside the run's plan (a ``hex.calibration.profile`` for the next run and ``areal-hex
   plan``). A refit that fails, whose model still misses the measurements by more than ``refit.DIVERGED`` (rms
   log error), or whose worker dies, keeps the running model and plan, and says why (the measurement it misses
   most; its residuals are logged, its factors not); the next refit starts a new worker;
2. the worker's re-plan decision under the refit model (``planner/refit_replan.py``): ``hex/replan/*`` gives the
   running plan's and the new plan's predicted tokens/s; where the new one wins by more than the refit
   prediction's uncertainty (``replan_threshold``, or the window's own where its steps scatter more:
   ``refit_replan.change_threshold``; ``hex/replan/threshold``) it is written to ``hex_replan.json`` and the log
   prints the command that resumes on it;
3. with ``hex.elastic.auto_replan``, the rollout shares are re-solved under the refit model here, through the
   elastic run's re-share path (live objects), which records the change in the plan's ``changes``, where they
   gain more than that same threshold; a suggestion that only starts, stops or re-lays out rollout servers is
   applied live, one machine at a time, from this thread (``live``: ``elastic/relayout.py``); any other
   suggestion that moves machines, or one the live path could not finish, is handed to the trainer
   (:meth:`take_restart`), which applies it at the next recover checkpoint (``auto_replan.py``), where the run
   may (``no_restart`` None).

Each refit's and decision's CPU seconds (the worker process's, all its threads) are logged as
``hex/calibration/cpu_s`` and ``hex/replan/cpu_s``. The run's end stops the worker.
"""

from __future__ import annotations

import math
import shlex
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal.utils import logging

from areal_hex_plugin.areal.auto_replan import restart_args, why_not
from areal_hex_plugin.areal.metrics import MEASURED, measured_train
from areal_hex_plugin.costmodel.calibration import Calibration
from areal_hex_plugin.costmodel.refit import Measured, MeasurementWindow, Refit, ServerSample, StepSample
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.outfiles import write_json
from areal_hex_plugin.plan import HexPlan
from areal_hex_plugin.planner.refit_replan import Decision, change_threshold, describe_changes
from areal_hex_plugin.planner.refit_worker import RefitJob, RefitOutcome, RefitWorker, WorkerDied

if TYPE_CHECKING:
    from areal_hex_plugin.areal.server_stats import ServerReading

logger = logging.getLogger("HexRefit")

PROFILE_FILE = "hex_profile.json"
REPLAN_FILE = "hex_replan.json"
# A refit needs medians of at least this many steps after warm-up.
MIN_STEPS = 2


def _key(text: str) -> str:
    return "_".join(str(text).split()).replace("/", "_")


def factor_metrics(fit: Refit) -> dict[str, float]:
    """``hex/calibration/<type>/<factor>``: each factor of each refit type, and each catalog figure refit in
    place of the recipe's (``hex/calibration/<type>/hbm_tb_per_s``)."""
    values = {t: {**fs, **fit.figures.get(t, {})} for t, fs in fit.factors.items()}
    return {f"hex/calibration/{_key(t)}/{f}": v for t, fs in values.items() for f, v in fs.items()}


def residual_metrics(fit: Refit, cpu_s: float) -> dict[str, float]:
    """How well one refit fits: each point's residual ln(model / measured) after the refit, their rms before and
    after, and its CPU seconds."""
    out = {}
    for p in fit.points:
        where = p.get("server") or p.get("pool") or p.get("gpu_type", "")
        out[f"hex/calibration/residual/{p['what']}/{_key(where)}"] = math.log(p["model"] / p["measured"])
    before = [
        math.log(p["before"] / p["measured"]) ** 2 for p in fit.points if p["before"] > 0 and "held" not in p
    ]
    out["hex/calibration/rms_log_error"] = fit.rms_log_error
    if before:
        out["hex/calibration/rms_log_error_before"] = math.sqrt(sum(before) / len(before))
    out["hex/calibration/cpu_s"] = cpu_s
    return out


def resume_command(argv: Sequence[str], plan_file: str, profile_file: str) -> str:
    """This run's own command with ``hex.plan_path`` and ``hex.calibration.profile`` set to the refit's files."""
    args = restart_args(argv, plan_file, profile_file)
    return shlex.join([sys.executable, "-m", "areal_hex_plugin.driver", *args])


def server_figures(readings: dict[int, ServerReading]) -> dict[str, float]:
    """Each server's step figures as ``hex/server/<rank>/*``: decode tokens/s, running requests, seconds per
    decode iteration and (where SGLang exposes it) the KV pool's used fraction."""
    out = {}
    for rank, r in readings.items():
        figures = {
            "tokens_per_s": r.tokens_per_s,
            "running": r.running,
            "decode_iteration_s": r.decode_iteration_s,
            "kv_usage": r.kv_usage,
        }
        out.update({f"hex/server/{rank}/{k}": v for k, v in figures.items() if v is not None})
    return out


class OnlineRefit:
    """The window of a run's measurements, the refit worker and the thread that waits for it (see the module
    doc).

    ``plan()`` gives the running plan, ``servers()`` each server rank's (pool, tp, pp) and ``take_servers()`` each
    rank's median reading since the last step (``ServerPoller.take``). ``apply_shares(calibration,
    reason, min_gain)`` re-solves the live shares under a refit (the elastic run's path; it records the change)
    and says whether they moved (only where they serve more than the threshold faster); None when
    ``auto_replan`` is off. ``live(decision, refit_step)`` applies a suggestion live where it can (None), else
    says why not; None when the run cannot. ``no_restart``: why a suggestion that moves machines is only
    suggested; None: it is applied at the next recover checkpoint (:meth:`take_restart`). ``worker`` runs each
    refit and decision (by default one of its own)."""

    def __init__(
        self,
        recipe,
        plan: Callable[[], HexPlan],
        servers: Callable[[], Sequence[tuple[str, int, int]]],
        take_servers: Callable[[], dict[int, ServerReading]],
        *,
        folder: str | Path,
        run: str,
        every: int,
        threshold: float,
        apply_shares: Callable[[Calibration, str, float], bool] | None = None,
        live: Callable[[Decision, int], str | None] | None = None,
        argv: Sequence[str] = (),
        window: MeasurementWindow | None = None,
        on_stop: Callable[[], None] = lambda: None,
        worker: RefitWorker | None = None,
        no_restart: str | None = "hex.elastic.auto_replan is false",
    ) -> None:
        self.recipe = recipe
        self._plan, self._servers, self._take_servers = plan, servers, take_servers
        self.folder = Path(folder)
        self.run, self.every, self.threshold = run, every, threshold
        self._apply_shares = apply_shares
        self._live = live
        self._argv = list(argv)
        self._on_stop = on_stop
        self._warned = False
        self.window = window or MeasurementWindow()
        self.calibration = recipe.calibration  # what the run believes now
        self.steps = 0
        self.refits: list[dict[str, Any]] = []  # one record per refit tried, for the run's summary and tests
        self._pending: dict[str, float] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.worker = worker or RefitWorker()
        self.no_restart = no_restart
        self._restart: tuple[Decision, int] | None = None
        self._restarting = False
        self._relaid = False  # a re-plan applied live: the next step starts the window anew

    @property
    def profile_file(self) -> Path:
        return self.folder / PROFILE_FILE

    @property
    def replan_file(self) -> Path:
        return self.folder / REPLAN_FILE

    # -- the training thread -----------------------------------------------------------------------------

    def on_step(self, data: dict[str, float], global_step: int | None = None) -> dict[str, float]:
        """One training step's figures (upstream's committed ``data`` at its ``global_step``, counted from 0;
        None: the steps this loop saw) into the window; every ``every`` steps a refit goes to the worker.
        Returns the step's server figures and the metrics of the refits that ended before this step; never raises
        into the training step."""
        self.steps += 1
        readings: dict[int, ServerReading] = {}
        with self._lock:
            relaid, self._relaid = self._relaid, False
        if relaid:  # the old layout's steps would be fitted as the new one's
            self.window.restart()
        try:
            readings = self._take_servers()
            self.window.add(
                self.sample(data, self.steps - 1 if global_step is None else global_step, readings)
            )
        except Exception as error:  # a measurement only: the step goes on, unmeasured
            logger.warning(
                f"step {self.steps} is not measured for the refit ({type(error).__name__}: {error})"
            )
        with self._lock:
            out, self._pending = {**server_figures(readings), **self._pending}, {}
        if self.steps % self.every == 0:
            try:
                self._start()
            except Exception as error:  # this refit is skipped; the step goes on
                logger.warning(f"step {self.steps}: no refit ({type(error).__name__}: {error})")
        return out

    def sample(
        self, data: dict[str, float], global_step: int, readings: dict[int, ServerReading]
    ) -> StepSample:
        """What step ``global_step`` measured: the servers' medians (``readings``), the train phase and (a step
        that pushed weights) the update."""
        shapes = list(self._servers())
        servers = tuple(
            ServerSample(*shapes[rank], r.running, r.tokens_per_s)
            for rank, r in readings.items()
            if rank < len(shapes)
        )
        window_steps = max(1, self._plan().solver.window_steps)
        pushed = (global_step + 1) % window_steps == 0  # the version after it is a multiple of the window
        sync = data.get(MEASURED["weight_sync_s"]) if pushed else None
        return StepSample(servers, measured_train(data).get("train_s"), sync)

    def _start(self) -> None:
        measured = self.window.measured()
        if measured.steps < MIN_STEPS:
            return
        if not measured.servers and not self._warned:
            self._warned = True
            logger.warning(
                "no rollout server exposes its decode speed (SGLang: --enable-metrics, upstream's default): the "
                "refit fits the train step and the weight update only"
            )
        if self._thread is not None and self._thread.is_alive():
            logger.info(f"step {self.steps}: the last refit still runs; this one is skipped")
            return
        self._thread = threading.Thread(
            target=self.refit_now, args=(measured, self.steps), name="hex-refit", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for a refit in flight (tests)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """The run ends: a refit in flight may finish within ``timeout``; the worker process ends; the servers
        are no longer read."""
        self.join(timeout)
        self.worker.stop()
        self._on_stop()
        cpu = [r["cpu_s"] for r in self.refits if "cpu_s" in r]
        logger.info(
            f"online refit: {len(cpu)} refits ({sum('kept' in r for r in self.refits)} kept the running model), "
            f"at most {max(cpu, default=0.0):.2f} CPU s each"
        )

    # -- the thread that waits for the worker ------------------------------------------------------------

    def refit_now(self, measured: Measured, step: int) -> dict[str, float]:
        """The worker's refit and decision, then the profile, the suggestion and the shares (see the module doc);
        the metrics, also queued for the next step."""
        record: dict[str, Any] = {"step": step}
        metrics = self._refit(measured, step, record)
        self.refits.append(record)
        with self._lock:
            self._pending.update(metrics)
        return metrics

    def _refit(self, measured: Measured, step: int, record: dict[str, Any]) -> dict[str, float]:
        plan = self._plan()
        try:
            threshold = change_threshold(self.threshold, measured)
            job = RefitJob(self.recipe, self.run, threshold, plan, self.calibration, measured, step)
            outcome = self.worker.run(job)
        except Exception as error:  # the worker died, or the job could not reach it: this refit failed
            record["kept"] = (
                f"{error}" if isinstance(error, WorkerDied) else f"{type(error).__name__}: {error}"
            )
            logger.warning(f"refit at step {step}: {record['kept']}; the running model and plan stay")
            return {"hex/calibration/failed": 1.0}
        fit, why, cpu = outcome.fit, outcome.why, outcome.cpu_s
        record["cpu_s"] = cpu
        if fit is None or why is not None:
            record["kept"] = why
            logger.warning(f"refit at step {step}: {why}; the running model and plan stay")
            fitted = {} if fit is None else residual_metrics(fit, cpu)
            return {**fitted, "hex/calibration/failed": 1.0, "hex/calibration/cpu_s": cpu}
        self.calibration = fit.calibration
        metrics = {**factor_metrics(fit), **residual_metrics(fit, cpu), "hex/calibration/failed": 0.0}
        record.update(factors=fit.factors, figures=fit.figures, rms_log_error=fit.rms_log_error)
        for why in fit.held:
            logger.warning(f"refit at step {step}: {why}")
        if fit.held:
            record["held"] = fit.held
        try:
            write_json(self.profile_file, fit.profile(), PROFILE_FILE)
        except HexError as error:  # the refit still counts for this run
            logger.warning(f"refit at step {step}: {error}")
        logger.info(
            f"refit at step {step} ({cpu:.2f} CPU s, steps {measured.first_step}-"
            f"{measured.first_step + measured.steps - 1}): residual {fit.rms_log_error:.1%}; "
            + "; ".join(
                f"{t}: " + ", ".join(f"{f} {v:.3g}" for f, v in {**fs, **fit.figures.get(t, {})}.items())
                for t, fs in fit.factors.items()
            )
            + f"; written to {self.profile_file}"
        )
        metrics.update(self._decide(outcome, step, record))
        return metrics

    def _decide(self, outcome: RefitOutcome, step: int, record: dict[str, Any]) -> dict:
        decision = outcome.decision
        if decision is None:
            logger.warning(f"refit at step {step}: no re-plan decision ({outcome.no_decision})")
            return {"hex/replan/failed": 1.0}
        record["decision"] = decision.to_dict()
        out = {
            "hex/replan/suggested": float(decision.suggested),
            "hex/replan/tokens_per_s_before": decision.running_tokens_per_s,
            "hex/replan/tokens_per_s_after": decision.tokens_per_s,
            "hex/replan/gain": decision.gain if math.isfinite(decision.gain) else 0.0,
            "hex/replan/machines": float(len(decision.diff)),
            "hex/replan/cpu_s": outcome.decision_cpu_s,
            "hex/replan/threshold": decision.threshold,
        }
        # The shares first: a live re-layout then weighs the servers under the refit model.
        if self._apply_shares is not None:
            moved = self._apply_shares(
                outcome.fit.calibration,
                f"refit at step {step}: shares re-solved under the refit model",
                decision.threshold,
            )
            out["hex/replan/shares_applied"] = float(moved)
            record["shares_applied"] = moved
        if decision.suggested:
            applied = self._suggest(decision, step)
            out["hex/replan/live"] = float(applied == "live")
            out["hex/replan/restart"] = float(applied == "restart")
        if self._apply_shares is None and decision.share_gain > decision.threshold:
            shares = ", ".join(f"{s:.3f}" for s in decision.shares)
            logger.info(
                f"refit at step {step}: the refit model re-shares the replica groups to {shares}; "
                "hex.elastic.auto_replan: true applies such changes live"
            )
        return out

    def _suggest(self, decision: Decision, step: int) -> str:
        """Write the new plan; apply one that moves machines live where it can ("live"), else hand it to the
        trainer where the run may restart on it ("restart"), else print the command that resumes on it ("")."""
        decision.plan.save(self.replan_file)
        said = (
            f"re-plan suggested by the refit model: {decision.tokens_per_s:,.1f} tokens/s predicted against "
            f"{decision.running_tokens_per_s:,.1f} for the running plan ({decision.gain:+.1%}, over the "
            f"{decision.threshold:.0%} threshold): {describe_changes(decision.diff, decision.retuned)}."
        )
        if decision.diff and self._live is not None and not self._restarting:
            logger.warning(f"{said} hex.elastic.auto_replan applies it live, one machine at a time")
            why = self._live(decision, step)
            if why is None:
                with self._lock:
                    self._relaid = True
                return "live"
            logger.warning(f"the re-plan of the refit at step {step} is not applied live: {why}")
        with self._lock:
            restart = self.no_restart is None and bool(decision.diff) and not self._restarting
            if restart:
                self._restart = (decision, step)
        if restart:
            logger.warning(
                f"{said} hex.elastic.auto_replan applies it at the next recover checkpoint: the run saves it, "
                "stops and goes on from it on the new plan"
            )
            return "restart"
        why = f" ({self.no_restart})" if self.no_restart and decision.diff else ""
        logger.warning(
            f"{said} These changes are not applied live{why}: resume from the recover checkpoint on the new plan "
            f"with\n  {resume_command(self._argv, str(self.replan_file), str(self.profile_file))}"
        )
        return ""

    def take_restart(self) -> tuple[Decision, int] | None:
        """The suggested decision to apply at this step's recover checkpoint and the step of its refit, once;
        after it no other is handed over (the run stops)."""
        with self._lock:
            pending, self._restart = self._restart, None
            self._restarting = self._restarting or pending is not None
        return pending


def attach_refit(trainer) -> OnlineRefit | None:
    """The online refit of the trainer's run (``hex.calibration.refit_every``), its servers read by a
    :class:`ServerPoller`; None when off or not a Hex rollout controller."""
    from areal_hex_plugin.areal.elastic.relayout import apply_live, live_why_not
    from areal_hex_plugin.areal.engines import HexRolloutController
    from areal_hex_plugin.areal.server_stats import ServerPoller

    config, rollout = trainer.config, trainer.rollout
    every = config.hex.calibration.refit_every
    if not every or not isinstance(rollout, HexRolloutController):
        return None
    poller = ServerPoller(
        lambda: [f"{info.host}:{info.port}" for info in rollout.server_infos],
        rollout.hex_in_flight,
    )
    elastic, auto = trainer.hex_elastic, config.hex.elastic
    no_restart = why_not(auto.auto_replan, auto.max_auto_replans, config.recover.mode, trainer.hex_plan)
    if no_restart is None and not trainer.hex_session.restarts:
        no_restart = "only the areal-hex driver restarts a run on a new plan"
    if auto.auto_replan and no_restart:
        logger.warning(f"hex.elastic.auto_replan: {no_restart}")
    loop = OnlineRefit(
        trainer.hex_session.recipe,
        lambda: trainer.hex_plan,
        lambda: [(s.pool, s.tp, s.pp) for s in rollout._slots()],
        poller.take,
        folder=trainer.hex_log_path(""),
        run=f"{config.experiment_name}/{config.trial_name}",
        every=every,
        threshold=config.hex.calibration.replan_threshold,
        apply_shares=elastic.recalibrate if elastic is not None and auto.auto_replan else None,
        live=partial(apply_live, trainer) if auto.auto_replan and live_why_not(config) is None else None,
        argv=sys.argv[1:],
        on_stop=poller.stop,
        no_restart=no_restart,
    )
    trainer.stats_logger.on_step.append(loop.on_step)
    poller.start()
    logger.info(
        f"online refit every {every} steps (the first {loop.window.warmup} dropped, medians over the last "
        f"{loop.window.kept.maxlen}); the refit profile goes to {loop.profile_file}"
    )
    return loop
