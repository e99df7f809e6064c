"""The pre-flight: every check a run needs, before anything starts, in one function that ``areal-hex check``, the
driver and its dry run share.

In order: the overrides' keys against upstream's config class; the ``hex:`` section (the core reader); the whole
upstream config through upstream's own loader with :class:`HexGRPOConfig`; the scheduler type; the workflow and
reward function; the transport's token; the plan (saved or solved now) against the recipe, its budget and the
backends; and the live inventory (Ray, Slurm or this machine) against the plan's hosts and GPU types. Each failure
is one :class:`HexError` naming the key and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_hex_plugin.areal.session import HexSession, open_session
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.schema_keys import KeyCheck

SOURCES = {"hex_local": "local", "hex_ray": "ray", "hex_slurm": "slurm"}


class InventoryUnreachable(HexError):
    """The scheduler's cluster could not be asked for its machines (no Ray cluster, no sinfo, no nvidia-smi)."""


def upstream_keys(key: str) -> KeyCheck:
    """``key`` against the whole config class: upstream's GRPO config plus the ``hex:`` section."""
    from areal_hex_plugin.areal.config import HexGRPOConfig
    from areal_hex_plugin.specs.schema_keys import check_key

    return check_key(HexGRPOConfig, key)


def _unknown_key(exc, path: str) -> HexError:
    key = getattr(exc, "full_key", None) or str(getattr(exc, "key", "") or "")
    check = upstream_keys(key) if key else KeyCheck(None)
    owner = getattr(getattr(exc, "object_type", None), "__name__", None)
    problem = f"unknown key in {path}" + (
        f" ({owner} has no field {key.rsplit('.', 1)[-1]!r})" if owner else ""
    )
    fix = (
        f"did you mean {check.meant}? rename {key} to {check.meant} in {path}"
        if check.meant
        else f"remove {key} from {path} or check its spelling"
    )
    return HexError(key or "recipe", problem, fix)


def load_upstream_config(path: str, overrides: list[str], save: bool = False):
    """The recipe as upstream loads an experiment (``--config FILE`` + Hydra overrides, merged over
    :class:`HexGRPOConfig`'s defaults). ``save``: through ``load_expr_config`` itself, which also points
    name_resolve at the recipe's and saves config.yaml to the log folder (a real run); else its loading steps
    only, writing nothing. Upstream's errors become one :class:`HexError`."""
    from areal.api.cli_args import load_expr_config, parse_cli_args, to_structured_cfg
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    from areal_hex_plugin.areal.config import HexGRPOConfig

    argv = ["--config", path, *overrides]
    try:
        if save:
            return load_expr_config(argv, HexGRPOConfig)[0]
        cfg, _ = parse_cli_args(argv)
        return OmegaConf.to_object(to_structured_cfg(cfg, config_cls=HexGRPOConfig))
    except (ConfigKeyError, ConfigAttributeError) as exc:
        raise _unknown_key(exc, path) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "recipe"
        problem = str(getattr(exc, "msg", None) or exc).splitlines()[0]
        raise HexError(key, problem, "give it a value of the type upstream's config declares") from None
    except HydraException as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigKeyError | ConfigAttributeError):
            raise _unknown_key(cause, path) from None
        raise HexError("recipe", str(exc).splitlines()[0], "fix the override or the recipe") from None


def _check_callable(path: str, field_name: str, kind: str, example: str) -> str:
    """``path`` names a ``kind`` in an installed module. The module is imported when it can be here; one that
    needs packages this machine lacks (it runs on the rollout workers) is found, not imported, and said so."""
    import importlib
    import importlib.util

    from areal_hex_plugin.specs.schema_keys import closest

    module, _, name = path.rpartition(".")
    wrong = HexError(
        field_name,
        f"{path!r} names no {kind} in an installed module",
        f"give an import path such as {example}",
    )
    try:
        if not (module and name) or importlib.util.find_spec(module) is None:
            raise wrong
    except (ImportError, ValueError):
        raise wrong from None
    try:
        loaded = importlib.import_module(module)
    except Exception as exc:  # a dependency of the module missing here: the workers must have it
        return f"{field_name}: {path} (found; not imported here: {type(exc).__name__}: {exc})"
    target = getattr(loaded, name, None)
    if target is None or (kind == "class" and not isinstance(target, type)) or not callable(target):
        meant = closest(name, [n for n in dir(loaded) if not n.startswith("_")])
        fix = (
            f"did you mean {module}.{meant}? write {field_name}={module}.{meant}"
            if meant
            else f"give an import path such as {example}"
        )
        raise HexError(field_name, f"{module} has no {kind} {name!r}", fix)
    return f"{field_name}: {path} imports"


def recover_root(config) -> Path:
    """Where upstream's recover dump of this trial lives (``Saver.get_save_root``'s layout, without making it)."""
    import getpass

    recover = config.recover
    user = getpass.getuser()
    return Path(recover.fileroot) / "checkpoints" / user / recover.experiment_name / recover.trial_name


def check_recover_config(config) -> None:
    """A run that writes recover checkpoints must be able to resume from them: upstream saves the optimizer's state
    unless ``recover.no_save_optim`` and loads it unless ``recover.no_load_optim``, and a resume that loads what
    was never saved fails in the workers."""
    recover = config.recover
    if recover.mode in ("off", "disabled") or not recover.no_save_optim or recover.no_load_optim:
        return
    raise HexError(
        "recover.no_load_optim",
        f"is false while recover.no_save_optim is true (recover.mode={recover.mode}): a resumed run would load "
        "optimizer state its recover checkpoints do not hold",
        "set recover.no_load_optim=true (resume with a fresh optimizer), or recover.no_save_optim=false (save it)",
    )


def check_recover_checkpoint(config) -> str | None:
    """A recover checkpoint the run would resume from was not being written when the last run stopped.

    Upstream writes the checkpoint in place, then its step info: a run stopped in between (a training rank lost
    during the dump) leaves weights newer than the step they are loaded as, possibly half of each step's."""
    if config.recover.mode in ("off", "disabled"):
        return None
    root = recover_root(config)
    info = root / "recover_info" / "step_info.json"
    if not info.is_file():
        return None
    written = info.stat().st_mtime
    for checkpoint in sorted(root.glob("*/recover_checkpoint")):
        newer = [path for path in checkpoint.rglob("*") if path.is_file() and path.stat().st_mtime > written]
        if newer:
            raise HexError(
                "recover",
                f"the recover checkpoint {checkpoint} was being written when the last run stopped: "
                f"{len(newer)} of its files are newer than its step info {info}, so its weights are not the "
                "step it would resume from",
                f"start this trial afresh (move {root} aside), or start a new trial_name from the last model "
                "the saver wrote (actor.path=<that folder>)",
            )
    progress = trained_steps(config)
    if progress is None:
        return f"recover: resumes from {info}"
    done, steps = progress
    if done >= steps:
        return f"recover: the run already trained its {steps} steps ({info}): the driver ends at once"
    return f"recover: resumes from {info} at step {done + 1} of {steps}"


def trained_steps(config) -> tuple[int, int] | None:
    """(steps trained, steps the run asks for) of the trial upstream would resume (``check_if_recover``): its
    step info's last global step, and ``total_train_epochs`` x its ``steps_per_epoch`` capped by
    ``total_train_steps`` as upstream's training loop counts them; None when upstream would start afresh."""
    import json

    from areal.utils.recover import check_if_recover

    info = recover_root(config) / "recover_info" / "step_info.json"
    if config.recover.mode in ("off", "disabled") or not info.is_file():
        return None
    if not check_if_recover(config.recover, 0):
        return None
    try:
        last = json.loads(info.read_text())
        done, per_epoch = int(last["global_step"]) + 1, int(last["steps_per_epoch"])
    except (OSError, ValueError, KeyError, TypeError):  # upstream would fail to load it: not ours to judge
        return None
    return done, steps_asked(config, per_epoch)


def steps_asked(config, per_epoch: int) -> int:
    """The steps upstream's training loop trains: ``total_train_epochs`` x ``per_epoch``, capped by
    ``total_train_steps``."""
    steps = int(config.total_train_epochs) * per_epoch
    if config.total_train_steps is not None:
        steps = min(steps, int(config.total_train_steps))
    return steps


def nothing_to_train(config) -> str | None:
    """Why a run would start every worker and server only to train nothing (its trial already trained every step
    it asks for), with the fix; None when there is a step to train."""
    progress = trained_steps(config)
    if progress is None or progress[0] < progress[1]:
        return None
    return (
        f"the run already trained its {progress[1]} steps ({recover_root(config)}), so nothing was started; to "
        "train on, raise total_train_steps or total_train_epochs; to train again from the start, set a new "
        "trial_name"
    )


def auto_replan_line(config, plan) -> str:
    """What ``hex.elastic.auto_replan`` does with a refit's re-plan that moves machines in this run of ``plan``:
    live (``elastic/relayout.py``), at the next recover checkpoint, or only suggested."""
    from areal_hex_plugin.areal.auto_replan import budget_spent, why_not
    from areal_hex_plugin.areal.elastic.relayout import live_why_not

    elastic = config.hex.elastic
    most = elastic.max_auto_replans
    spent = budget_spent(plan, most)
    if spent is not None:
        return f"auto_replan: only suggested: {spent}"
    at_checkpoint = why_not(True, most, config.recover.mode, plan)
    later = (
        "applies at the next recover checkpoint (the driver goes on from it on the new plan)"
        if at_checkpoint is None
        else f"is only suggested: {at_checkpoint}"
    )
    live = live_why_not(config)
    if live is not None:
        return (
            f"auto_replan: a re-plan that moves machines {later} (at most {most} a trial; not live: {live})"
        )
    return (
        "auto_replan: a re-plan that only starts, stops or re-lays out rollout servers applies live, one machine at "
        f"a time (the servers left keep {elastic.min_rollout_capacity:.0%} of the rollout capacity); any other "
        f"{later} (at most {most} a trial)"
    )


def check_live_inventory(session: HexSession) -> str:
    """The plan's machines against the live cluster ``scheduler.type`` runs on: its GPU types, and its hosts or
    as many machines of each type (hex_local: the GPUs of this machine)."""
    from areal_hex_plugin.areal.worker_slots import (
        SHARE_GPUS_ENV,
        check_local_gpus,
        check_plan_fits_inventory,
    )
    from areal_hex_plugin.inventory import group_pools

    kind = session.config.scheduler.type
    source = SOURCES[kind]
    try:
        machines = list(session.live_inventory(source).machines)
    except HexError as exc:
        raise InventoryUnreachable(
            f"scheduler.type={kind}",
            f"cannot read the live {source} inventory ({exc.field}: {exc.problem})",
            f"{exc.fix}; or check everything else with areal-hex check RECIPE --offline",
        ) from None
    if source == "local":
        check_local_gpus(session.plan, machines, os.environ.get(SHARE_GPUS_ENV) == "1")
    else:
        check_plan_fits_inventory(session.plan, group_pools(machines), source)
    found = ", ".join(f"{m.gpus} x {m.gpu_name}" for m in machines[:4]) + (
        " ..." if len(machines) > 4 else ""
    )
    return f"live inventory ({source}): {len(machines)} machines ({found}) host the plan"


def check_transport(config) -> None:
    """What the relay transport needs from the config and the environment, checked before any worker starts."""
    from areal_hex_plugin.areal.rewrite import uses_relay

    if not uses_relay(config):
        return
    mode = config.actor.weight_update_mode
    if mode not in ("xccl", "hex_relay"):  # hex_relay: upstream's own actor finds the relay (patches/0003)
        raise HexError(
            "actor.weight_update_mode",
            f"is {mode!r}, but hex.transport=relay sends weights in place of upstream's xccl buckets",
            "set actor.weight_update_mode=xccl (hex_relay with patches/0003), or hex.transport=upstream to keep "
            "upstream's own path",
        )
    megatron = config.actor.megatron
    if megatron.bridge_type == "megatron-bridge" and megatron.use_bridge_for_update_weights:
        raise HexError(
            "actor.megatron.use_bridge_for_update_weights",
            "is true: megatron-bridge's export hands every pipeline stage the whole model, and the relay sends "
            "each stage's own layers",
            "set it to false (upstream's convert_to_hf path, its default), or hex.transport=upstream",
        )
    from areal_hex_plugin.transport.wire import load_token

    load_token()


def check_config(config) -> list[str]:
    """The checks of a loaded upstream config beside its scheduler's: plan output, workflow and reward function,
    recover settings and transport; a line for each passed, the first failure raised. Also run for a session
    upstream's own script opened (``schedulers/common.announced_session``), which no pre-flight saw."""
    from areal_hex_plugin.outfiles import check_writable

    check_writable(config.hex.plan_out, "hex.plan_out")
    passed = [
        _check_callable(
            config.hex.workflow, "hex.workflow", "class", "areal.workflow.openai.math_agent.MathAgent"
        )
    ]
    if config.hex.reward_fn is not None:
        passed.append(
            _check_callable(
                config.hex.reward_fn, "hex.reward_fn", "function", "areal.reward.gsm8k.gsm8k_reward_fn"
            )
        )
    check_recover_config(config)
    resuming = check_recover_checkpoint(config)
    if resuming:
        passed.append(resuming)
    check_transport(config)
    passed.append(
        f"transport: {config.hex.transport}" + (" (token set)" if config.hex.transport == "relay" else "")
    )
    return passed


def preflight(path: str, overrides: list[str], offline: bool = False, run: bool = False) -> HexSession:
    """Run every check (``areal-hex check``; ``offline``: all but the live inventory) and open the run's session.
    ``run``: for the driver, which loads the config as a real run does (:func:`load_upstream_config` with
    ``save``), and whose dry run takes an unreachable cluster as a note (a reachable one that lacks the plan's
    machines still fails)."""
    from areal_hex_plugin.areal.launch import check_scheduler_type
    from areal_hex_plugin.areal.plugin import register
    from areal_hex_plugin.areal.rewrite import apply_plan
    from areal_hex_plugin.saved_plan import obtain_plan
    from areal_hex_plugin.specs.overrides import checked_overrides
    from areal_hex_plugin.specs.recipe import load_recipe

    register()
    overrides = checked_overrides(overrides, upstream_keys)
    recipe = load_recipe(path, overrides)  # the core reader: precise messages for a bad hex: section
    dry_run = recipe.hex.dry_run
    config = load_upstream_config(path, overrides, save=run and not dry_run)
    check_scheduler_type(config.scheduler.type)
    passed = [
        f"upstream config: {path} loads as HexGRPOConfig ({len(overrides)} overrides)",
        f"scheduler: {config.scheduler.type}",
        *check_config(config),
    ]
    plan, source = obtain_plan(recipe, config.hex.plan_path)
    rewrite = apply_plan(config, plan)  # refuses a plan these backends cannot start
    passed.append(
        f"plan: {source}; ${plan.predicted.cost_per_hour:,.2f}/h, {plan.predicted.tokens_per_s:,.0f} tokens/s"
    )
    if config.hex.elastic.auto_replan:
        passed.append(auto_replan_line(config, plan))
    session = HexSession(recipe, config, plan, source, rewrite, passed, finished=nothing_to_train(config))
    if offline:
        session.notes.append("live inventory: not checked (--offline)")
    elif session.finished:
        session.notes.append("live inventory: not checked (nothing left to train)")
    else:
        try:
            passed.append(check_live_inventory(session))
        except InventoryUnreachable as exc:
            if not (run and dry_run):
                raise
            session.notes.append(f"live inventory: not checked ({exc.problem})")
    return open_session(session)
