"""``HexPPOTrainer``: upstream's PPOTrainer that follows a HexPlan, used exactly like PPOTrainer.

It follows the run's :class:`~areal_hex_plugin.areal.session.HexSession` (``session=``, made by the driver's
pre-flight; else the session for the config, :func:`session_for`), whose plan has already rewritten the config.
``_init_scheduler`` runs before upstream parses any backend string: it saves ``hex_plan.json`` beside upstream's
``config.yaml`` and returns the Hex scheduler for ``scheduler.type``.
Rollout servers use the engine class :func:`register` installed (``HexRemoteSGLangEngine``: per-GPU-type flags,
share routing), through ``_rollout_engine_cls`` (upstream's hook with ``patches/0002``). With
``hex.transport: relay`` the actor is the transport's ``HexFSDPPPOActor`` or ``HexMegatronRelayActor`` and its
controller gets the plan's rollout pools and links. Upstream's stats logger is wrapped to add ``hex/*``. Rollout
servers lost and gained mid-run (and machines that join, ``areal-hex join``) and length drift are handled by
:mod:`elastic` (``hex.elastic``); each change is appended to ``hex_plan.json``. Every
``hex.calibration.refit_every`` steps the cost model is refit from the run's own measurements beside the trainer
(:mod:`refit_loop`); with ``hex.elastic.auto_replan`` a re-plan it suggests that moves machines is applied at the
next recover checkpoint, after which the step ends in :class:`~areal_hex_plugin.areal.auto_replan.Restart`
(:mod:`auto_replan`).
Weights go to the rollout servers every ``plan.solver.window_steps`` steps (:mod:`update_window`). Where upstream
would never evaluate (:func:`evaluates`), no eval-rollout workers are started.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from areal.trainer import rl_trainer
from areal.trainer.rl_trainer import PPOTrainer
from areal.utils import logging
from areal.utils.stats_logger import StatsLogger

from areal_hex_plugin.areal.auto_replan import Restart, applied_plan, applied_so_far, forced_dump
from areal_hex_plugin.areal.elastic import attach_elastic
from areal_hex_plugin.areal.launch import scheduler_factory
from areal_hex_plugin.areal.metrics import HexStatsLog
from areal_hex_plugin.areal.plugin import ROLLOUT_ENGINES, TRAIN_ENGINES, load, register, swapped
from areal_hex_plugin.areal.preflight import steps_asked
from areal_hex_plugin.areal.refit_loop import attach_refit
from areal_hex_plugin.areal.rewrite import uses_relay
from areal_hex_plugin.areal.session import HexSession, session_for
from areal_hex_plugin.areal.transport_setup import reroute, transport_settings
from areal_hex_plugin.areal.update_window import push_every
from areal_hex_plugin.plan import HexPlan, PlanChange

PLAN_FILE = "hex_plan.json"
logger = logging.getLogger("HexPPOTrainer")


def evaluates(evaluator, has_valid_data: bool) -> bool:
    """Whether upstream's trainer would ever evaluate: a validation set, and an ``evaluator`` config with a
    frequency or ``eval_before_train`` (upstream's Evaluator never fires without one)."""
    fires = evaluator.eval_before_train or any(
        f is not None for f in (evaluator.freq_epochs, evaluator.freq_steps, evaluator.freq_secs)
    )
    return has_valid_data and fires


def save_plan_beside_config(config, plan: HexPlan) -> str:
    """Write ``hex_plan.json`` into the folder where upstream saved ``config.yaml``."""
    folder = StatsLogger.get_log_path(config.stats_logger)
    os.makedirs(folder, exist_ok=True)
    return str(plan.save(os.path.join(folder, PLAN_FILE)))


class HexPPOTrainer(PPOTrainer):
    def __init__(
        self,
        config,
        train_dataset=None,
        valid_dataset=None,
        *,
        session: HexSession | None = None,
        make_scheduler: Callable[[], object] | None = None,
    ) -> None:
        register()
        if session is None:
            from areal_hex_plugin.areal.startup import announce

            session = session_for(config, "HexPPOTrainer")
            announce(session)
        self.hex_session = session
        plan = self.hex_session.plan
        # The driver checks the live cluster first and passes the builder; otherwise it is checked here.
        self._make_scheduler = make_scheduler
        super().__init__(config, train_dataset, valid_dataset)
        # After __init__: a resumed run pushes its weights inside it, whatever the window.
        rollouts = [r for r in (self.rollout, self.eval_rollout) if r is not None]
        self._hex_window = push_every(plan.solver.window_steps, self.actor, rollouts)
        self.stats_logger = HexStatsLog(self.stats_logger, plan)
        self._hex_plan_lock = threading.Lock()
        self.hex_elastic = attach_elastic(self)
        self.hex_refit = attach_refit(self)
        self._hex_restart: Restart | None = None

    @property
    def hex_plan(self) -> HexPlan:
        """The running plan, with the changes made during the run."""
        return self.hex_session.plan

    # -- elastic rollout (areal/elastic/) ----------------------------------------------------------------

    def hex_record_change(self, change: PlanChange) -> None:
        """Append a change to the running plan and rewrite ``hex_plan.json`` beside upstream's config."""
        with self._hex_plan_lock:
            session = self.hex_session
            session.plan = replace(session.plan, changes=[*session.plan.changes, change])
            save_plan_beside_config(self.config, session.plan)

    def hex_replace_plan(self, new: Callable[[HexPlan], HexPlan]) -> None:
        """The running plan becomes ``new(running plan)`` (a re-plan applied live, ``elastic/relayout.py``),
        rewritten beside upstream's config; its update window and rollouts admitted at once hold from the next
        step."""
        with self._hex_plan_lock:
            session = self.hex_session
            session.plan = plan = new(session.plan)
            save_plan_beside_config(self.config, plan)
        self._hex_window.steps = plan.solver.window_steps
        if self.hex_elastic is not None:
            self.hex_elastic.policy.window = plan.solver.window_steps
        admitted = plan.staleness.max_concurrent_rollouts
        self.config.rollout.max_concurrent_rollouts = admitted
        for rollout in (self.rollout, self.eval_rollout):
            manager = getattr(rollout, "_staleness_manager", None)
            if manager is not None:
                manager.max_concurrent_rollouts = admitted
        logger.warning(f"{plan.changes[-1].reason}: the run goes on on this plan")

    def hex_relaunches(self) -> bool:
        """A relaunched server can receive the current version only over the relay."""
        return uses_relay(self.config)

    def hex_relaunch_server(self, rank: int) -> str:
        """Start rollout server ``rank`` again (:meth:`HexRolloutController.hex_relaunch`); the eval-rollout
        engine beside it follows it to its new port. Its ``host:port``."""
        address = self.rollout.hex_relaunch(rank)
        if self.eval_rollout is not None:
            self.eval_rollout.hex_follow(rank, address)
        return address

    def hex_set_shares(self, shares: Sequence[float]) -> None:
        """Route rollouts by ``shares`` (one per server); evaluation follows over the servers it has."""
        self.rollout._router().set_shares(shares)
        if self.eval_rollout is not None:
            self.eval_rollout.hex_route_like(shares)

    def hex_in_flight(self, rank: int) -> int:
        """Requests server ``rank`` holds now, evaluation's included (a live re-layout's drain waits for both)."""
        evaluation = self.eval_rollout.hex_in_flight(rank) if self.eval_rollout is not None else 0
        return self.rollout.hex_in_flight(rank) + evaluation

    def hex_join(self, request, busy: set[str]):
        """Start the servers of a machine that joins (``areal-hex join``); :func:`join.join_machine`."""
        from areal_hex_plugin.areal.join import join_machine

        return join_machine(self, request, busy)

    def hex_reroute(self, reachable: list[bool]) -> None:
        reroute(self.actor, self.rollout, reachable)

    def hex_log_path(self, name: str) -> str:
        return os.path.join(StatsLogger.get_log_path(self.config.stats_logger), name)

    def _train_engine_cls(self, backend: str) -> type | None:
        """The train engine :func:`register` installed for ``hex.transport`` and this actor backend, if any."""
        register()
        path = TRAIN_ENGINES.get((self.config.hex.transport, backend))
        return load(path) if path else None

    def _init_scheduler(self):
        save_plan_beside_config(self.config, self.hex_plan)
        build = self._make_scheduler or scheduler_factory(self.hex_session)
        return build()

    def _create_train_engine(self, actor_config, alloc):
        engine_cls = self._train_engine_cls(alloc.backend) if actor_config is self.config.actor else None
        if engine_cls is None:
            return super()._create_train_engine(actor_config, alloc)
        actor = engine_cls.as_controller(actor_config, self.scheduler)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        if uses_relay(self.config):
            # Configured here, not after __init__: upstream's recovery updates weights inside __init__ on a resume.
            session = self.hex_session
            settings = transport_settings(session.placement, session.recipe.cluster, self.config.hex.relay)
            actor.configure_hex_transport(settings)
        return actor

    # -- re-plans applied at a recover checkpoint (auto_replan.py) ---------------------------------------

    def _save_recover_checkpoint(self, epoch: int, epoch_step: int, global_step: int):
        pending = self.hex_refit.take_restart() if getattr(self, "hex_refit", None) is not None else None
        if pending is not None and global_step + 1 >= steps_asked(self.config, len(self.train_dataloader)):
            logger.info("the refit's re-plan comes at the run's last step: nothing is left to train on it")
            pending = None
        if pending is None:
            return super()._save_recover_checkpoint(epoch, epoch_step, global_step)
        with forced_dump(self.recover_handler):
            super()._save_recover_checkpoint(epoch, epoch_step, global_step)
        self._hex_restart = self._hex_apply(*pending, global_step)

    def _hex_apply(self, decision, refit_step: int, step: int) -> Restart:
        """Record the refit's re-plan in the running plan and write the plan the run goes on with."""
        plan = applied_plan(
            self.hex_plan, decision, refit_step, step, self.config.hex.elastic.max_auto_replans
        )
        change = plan.changes[-1]
        self.hex_record_change(change)
        path = plan.save(self.hex_log_path(f"hex_plan.auto{applied_so_far(plan)}.json"))
        logger.warning(f"{change.reason}: the run stops after this step and goes on on {path}")
        return Restart(str(path), str(self.hex_refit.profile_file), step, change)

    def _save_perf_tracer(self, step: int):
        super()._save_perf_tracer(step)
        if self._hex_restart is not None:  # the step's last act: the run stops after it
            raise self._hex_restart

    def close(self):
        # The elastic run first: a live re-layout waiting in the refit's thread then ends at once.
        if getattr(self, "hex_elastic", None) is not None:
            self.hex_elastic.stop()
        if getattr(self, "hex_refit", None) is not None:
            self.hex_refit.stop()
        # Upstream destroys the rollout before the actor: stop the receivers (and free their staged weights) first.
        stop_receivers = getattr(self.actor, "stop_receivers", None)
        if stop_receivers is not None:
            stop_receivers()
        super().close()

    def _rollout_engine_cls(self, backend: str) -> type:
        """The rollout engine class for ``backend``: the one :func:`register` installed, else upstream's
        (``patches/0002`` makes this upstream's own hook)."""
        register()
        if backend in ROLLOUT_ENGINES:
            return load(ROLLOUT_ENGINES[backend])
        return {"sglang": rl_trainer.RemoteSGLangEngine, "vllm": rl_trainer.RemotevLLMEngine}[backend]

    def _init_rollout(self, rollout_config, is_eval: bool = False, lora_path: str | None = None):
        if is_eval and not evaluates(self.config.evaluator, self.valid_dataloader is not None):
            # Upstream starts an eval-rollout worker beside every rollout worker whether or not it evaluates;
            # every use of it allows None.
            logger.info(
                "no evaluation configured (evaluator frequencies null or no validation set): no eval-rollout workers"
            )
            return None
        if hasattr(PPOTrainer, "_rollout_engine_cls"):  # patches/0002: upstream asks the method above
            return super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)
        with swapped(rl_trainer, "RemoteSGLangEngine", self._rollout_engine_cls("sglang")):
            return super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)
