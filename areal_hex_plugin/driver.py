"""``python -m areal_hex_plugin.driver --config RECIPE.yaml [Hydra overrides]``: run a recipe on upstream AReaL.

Same shape as upstream's example scripts (and usable as an ``areal train run --driver`` function on 2.x): the
pre-flight of ``areal-hex check`` (``areal/preflight.py``) loads the recipe, takes the plan (``hex.plan_path``, or
solves it now), rewrites the upstream config and checks the plan against the recipe's cluster and the live one, and
hands back the run's session; the driver then trains with ``HexPPOTrainer`` on it and the recipe's
``hex.workflow``. ``hex.dry_run=true`` runs the same checks, prints the rewritten config and the placement and
exits without starting anything. Bad input exits 2 with one message. A run that applies a refit's
re-plan at a recover checkpoint (``hex.elastic.auto_replan``, ``areal/auto_replan.py``) goes on from it in the same
process, on the new plan (:func:`restart`).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from typing import NoReturn

from areal_hex_plugin.commands.common import refuse_several_recipes
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.fast_exit import freeze_heap_at_exit


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """The recipe path and the Hydra overrides of ``--config PATH key=value ...``."""
    rest, path = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if not path:
        raise HexError(
            "--config", "is missing", "run: python -m areal_hex_plugin.driver --config RECIPE.yaml"
        )
    refuse_several_recipes("--config", path, rest)
    return path, rest


def run(argv: list[str]) -> int:
    path, overrides = split_argv(argv)
    # First, before the seconds importing upstream takes: the run has begun.
    print(f"areal-hex: {path}: planning and checking before anything starts", file=sys.stderr, flush=True)
    from areal_hex_plugin.areal.launch import scheduler_factory
    from areal_hex_plugin.areal.preflight import preflight
    from areal_hex_plugin.areal.startup import announce, describe_start
    from areal_hex_plugin.outfiles import write_json
    from areal_hex_plugin.progress import working

    with working(f"areal-hex: loading upstream AReaL, planning and checking {path}"):
        session = preflight(path, overrides, run=True)  # every check of `areal-hex check`
    config = session.config
    if config.hex.plan_out:
        written = write_json(config.hex.plan_out, session.plan.to_dict(), "hex.plan_out")
        print(f"plan written to {written}", file=sys.stderr)
    if config.hex.dry_run:
        print(describe_start(session, dry_run=True))
        return 0
    if session.finished:
        print(f"areal-hex: {session.finished}", file=sys.stderr)
        return 0
    announce(session)
    session.restarts = True  # a re-plan applied at a checkpoint: main goes on from it (restart)
    return _train(session, scheduler_factory(session), path, overrides)


def workflow_kwargs(config, temperature: float | None = None) -> dict:
    """What the workflow is built with: a RolloutWorkflow with ``hex.reward_fn`` gets the reward function, the
    gconfig and the tokenizer path (upstream's RLVR examples); an agent gets the sampling settings."""
    gconfig = config.gconfig if temperature is None else config.gconfig.new(temperature=temperature)
    if config.hex.reward_fn is not None:
        return dict(reward_fn=config.hex.reward_fn, gconfig=gconfig, tokenizer=config.tokenizer_path)
    return dict(
        temperature=gconfig.temperature,
        top_p=gconfig.top_p,
        max_tokens=gconfig.max_tokens,
        max_completion_tokens=gconfig.max_new_tokens,
    )


EXIT_LOST = 3  # the run stopped because a training machine was lost: replan and resume


class TrainingLost(HexError):
    """A training rank stopped answering: the run cannot go on with its layout (exit :data:`EXIT_LOST`)."""


def lost_training_hosts(trainer) -> list[str]:
    """The hosts of the training ranks whose worker no longer answers ``/health`` (before the trainer closes)."""
    from areal_hex_plugin.areal.elastic import http_probe

    slots = trainer.scheduler.placement.for_role("actor") or ()
    workers = getattr(trainer.actor, "workers", None) or []
    dead = [
        slot.host
        for worker, slot in zip(workers, slots, strict=False)
        if not http_probe(f"{worker.ip}:{worker.worker_ports[0]}", 2.0)
    ]
    return sorted(set(dead))


def resume_fix(recipe: str, overrides: list[str], config, lost: list[str], plan_file: str) -> str:
    """Pasteable commands: re-plan the run's plan (``plan_file``) without the ``lost`` hosts, then resume from
    upstream's recover checkpoint on the new plan with this run's overrides."""
    from pathlib import Path

    new = str(Path(plan_file).with_name("hex_plan.replanned.json"))
    kept = [o for o in overrides if not o.lstrip("+").startswith("hex.plan_path=")]
    resume = [*kept, f"hex.plan_path={new}"]
    replan = ["areal-hex", "replan", "--plan", plan_file, "--lost", ",".join(lost), "--recipe", recipe]
    drive = [sys.executable, "-m", "areal_hex_plugin.driver", "--config", recipe, *resume]
    off = config.recover.mode in ("off", "disabled")
    note = f" (recover.mode is {config.recover.mode}: it starts again from step 0)" if off else ""
    return f"{shlex.join([*replan, '--json', new, *kept])} && {shlex.join(drive)}{note}"


def _train(session, make_scheduler, recipe: str, overrides: list[str]) -> int:
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    from areal_hex_plugin.areal.auto_replan import Restart
    from areal_hex_plugin.areal.run_guard import RunFailed, RunGuard, RunStopped, closed
    from areal_hex_plugin.areal.trainer import PLAN_FILE, HexPPOTrainer
    from areal_hex_plugin.areal.worker_slots import ROLLOUT_ROLE, TRAIN_ROLE
    from areal_hex_plugin.progress import working

    config = session.config
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset(
        split="train", dataset_config=config.train_dataset, tokenizer=tokenizer
    )
    valid_dataset = None
    if config.valid_dataset is not None:
        valid_dataset = get_custom_dataset(
            split="test", dataset_config=config.valid_dataset, tokenizer=tokenizer
        )
    lost: list[str] = []
    replanned: Restart | None = None
    slots = session.placement.slots
    starting = (
        f"areal-hex: upstream AReaL is starting {len(slots[TRAIN_ROLE])} training workers and "
        f"{len(slots[ROLLOUT_ROLE])} rollout servers ({config.scheduler.type})"
    )
    guard = RunGuard()
    guard.install()
    session.end_run = guard.fail  # the elastic run's watcher says when no rollout server can serve
    trainer = None
    try:
        with working(starting):
            trainer = HexPPOTrainer(
                config, train_dataset, valid_dataset, session=session, make_scheduler=make_scheduler
            )
        # Watched once started: upstream replaces a worker that fails to start (a port taken) on its own, and
        # raises for one it cannot start.
        guard.watch()
        with closed(trainer):
            try:
                trainer.train(
                    workflow=config.hex.workflow,
                    workflow_kwargs=workflow_kwargs(config),
                    eval_workflow=config.hex.workflow if valid_dataset is not None else None,
                    eval_workflow_kwargs=workflow_kwargs(config, temperature=0.6),
                )
                guard.ending(0)
            except Restart as applied:
                # After the step's recover checkpoint: the trainer closes its workers, then main goes on.
                replanned = applied
                guard.ending(0)
            except RunStopped as stopped:
                guard.ending(stopped.exit_code, stopped.error)
                raise
            except (Exception, RunFailed) as error:
                cause = (
                    str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
                )
                failure = (
                    error.error
                    if isinstance(error, RunFailed)
                    else HexError("run", cause, "read the log above")
                )
                guard.ending(2, failure)
                lost = lost_training_hosts(trainer)  # asked before the trainer closes its workers
                if not lost:
                    raise
                lost_error = TrainingLost(
                    "training",
                    f"lost {', '.join(lost)} (its training rank stopped answering: {cause}); the run cannot go on "
                    "with its training layout",
                    resume_fix(recipe, overrides, config, lost, trainer.hex_log_path(PLAN_FILE)),
                )
                guard.ending(EXIT_LOST, lost_error)
    finally:
        forget_workers(trainer)
        guard.close()  # no process of the run outlives it
    if lost:
        raise lost_error
    if replanned is not None:
        raise replanned
    return 0


def forget_workers(trainer) -> None:
    """Have upstream's scheduler let go of every worker now: a close that failed part-way leaves some listed, and
    its ``__del__`` would delete them at interpreter exit, starting threads that can no longer start (a hang)."""
    scheduler = getattr(trainer, "scheduler", None)
    if scheduler is None:
        return
    try:
        scheduler.delete_workers()
    except Exception as error:  # their processes go with the run guard's close
        print(f"areal-hex: letting go of the run's workers: {error}", file=sys.stderr, flush=True)


def restart(argv: list[str], replanned) -> NoReturn:
    """Go on from the recover checkpoint of a re-plan the run applied (``areal/auto_replan.py``): this process
    becomes the driver again, with ``argv`` on the new plan and the refit profile."""
    from areal_hex_plugin.areal.auto_replan import restart_args

    command = [
        sys.executable,
        "-m",
        "areal_hex_plugin.driver",
        *restart_args(argv, replanned.plan_file, replanned.profile_file),
    ]
    print(
        f"areal-hex: re-planned ({replanned.change.reason}); going on from the recover checkpoint after step "
        f"{replanned.step + 1}:\n  {shlex.join(command)}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os.execv(sys.executable, command)


def main(argv: list[str] | None = None) -> int:
    """The driver; a run that applies a re-plan at a recover checkpoint goes on in this process (:func:`restart`:
    it never returns then)."""
    from areal_hex_plugin.areal.auto_replan import Restart
    from areal_hex_plugin.areal.run_guard import RunEnded

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(argv)
    except Restart as replanned:
        restart(argv, replanned)
    except TrainingLost as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_LOST
    except HexError as exc:
        print(f"error: {_pasteable(exc, argv).message}", file=sys.stderr)
        return 2
    except RunEnded as ended:  # a worker died, or the driver was stopped
        print(f"error: {_pasteable(ended.error, argv).message}", file=sys.stderr)
        return ended.exit_code


def _pasteable(exc: HexError, argv: list[str]) -> HexError:
    """The error with its fix naming this run's recipe and saved plan (``hex.plan_path``)."""
    from areal_hex_plugin.cli import pasteable

    try:
        path, overrides = split_argv(argv)
    except HexError:
        return exc
    plans = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hex.plan_path=")]
    exc.fix = pasteable(exc.fix, path, plans[-1] if plans else None)
    return exc


EXIT_S = 60  # at most this long from main's end to the process's: upstream's teardown can hang at exit


if __name__ == "__main__":
    code = main()
    freeze_heap_at_exit()  # the run's end is the process's (fast_exit.py)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(EXIT_S)  # the kernel ends the process if interpreter exit hangs; no thread can start then
    sys.exit(code)
