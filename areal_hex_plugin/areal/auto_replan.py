"""Re-plans the run applies on its own (``hex.elastic.auto_replan``): a refit's suggestion that moves machines
between roles or layouts, applied at the next recover checkpoint.

The online refit (``refit_loop.py``) hands a suggested :class:`~areal_hex_plugin.planner.refit_replan.Decision`
whose ``diff`` is not empty to the trainer; at the end of the next training step the trainer writes upstream's
recover checkpoint whatever ``recover.freq_*`` say (:func:`forced_dump`), writes the new plan with the change
recorded (:func:`applied_plan`) beside its own and stops with :class:`Restart`. The driver closes the run and
starts itself again with the same arguments, ``hex.plan_path`` the new plan and ``hex.calibration.profile`` the
refit profile (:func:`restart_args`); upstream's recovery resumes the trial from that checkpoint.

Loops are bounded: the plan's ``changes`` count the re-plans applied so far in the trial (kind
:data:`AUTO_KIND`), at most ``hex.elastic.max_auto_replans``. The restarted run keeps no decision of the run before
it: only its own refits, from its own measurements after their warm-up, can apply another. Without recover
checkpoints (``recover.mode`` off or disabled) the run would start again from step 0, so the re-plan is only
suggested (:func:`why_not`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from areal_hex_plugin.plan import HexPlan, PlanChange
from areal_hex_plugin.planner.refit_replan import Decision, describe_changes
from areal_hex_plugin.planner.replan import share_key

AUTO_KIND = "auto_replan"
RECOVER_OFF = ("off", "disabled")


def applied_so_far(plan: HexPlan) -> int:
    """The re-plans the trial of ``plan`` applied on its own (its ``changes`` of kind :data:`AUTO_KIND`)."""
    return sum(c.kind == AUTO_KIND for c in plan.changes)


def budget_spent(plan: HexPlan, most: int) -> str | None:
    """Why the trial of ``plan`` applies no more re-plans on its own (``hex.elastic.max_auto_replans``)."""
    done = applied_so_far(plan)
    if done < most:
        return None
    return f"this trial applied {done} re-plans on its own, hex.elastic.max_auto_replans={most}"


def why_not(auto_replan: bool, most: int, recover_mode: str, plan: HexPlan) -> str | None:
    """Why this run cannot apply a re-plan on its own (then it is only suggested); None when it can."""
    if not auto_replan:
        return "hex.elastic.auto_replan is false"
    if recover_mode in RECOVER_OFF:
        return (
            f"recover.mode is {recover_mode}: without recover checkpoints the run would go on from step 0, so "
            "role and layout changes are only suggested (recover.mode=auto applies them at a checkpoint)"
        )
    spent = budget_spent(plan, most)
    return None if spent is None else f"{spent}: role and layout changes are only suggested"


def applied_plan(
    running: HexPlan, decision: Decision, refit_step: int, step: int, most: int, live: bool = False
) -> HexPlan:
    """``decision``'s plan with the running plan's changes and this one (kind :data:`AUTO_KIND`): which machines
    move, why, and how: ``live`` (``elastic/relayout.py``) during global step ``step``, else at the recover
    checkpoint the run goes on from (of global step ``step``, counted from 0 as upstream's loop counts; its log
    says step ``step + 1``)."""
    number = applied_so_far(running) + 1
    new = decision.plan
    if live:
        how = f"applied live, machine by machine, during step {step + 1} (global step {step})"
    else:
        how = (
            f"applied at the recover checkpoint after step {step + 1} (global step {step}), the run restarted on "
            "this plan"
        )
    change = PlanChange(
        kind=AUTO_KIND,
        hosts=sorted({d.host for d in decision.diff}),
        reason=f"refit at step {refit_step}: the refit model plans {decision.tokens_per_s:,.0f} tokens/s against "
        f"the running plan's {decision.running_tokens_per_s:,.0f} ({decision.gain:+.1%}, over the "
        f"{decision.threshold:.0%} threshold): {describe_changes(decision.diff, decision.retuned)}; {how} "
        f"(automatic re-plan {number} of at most {most})",
        step=step,
        tokens_per_s_before=round(decision.running_tokens_per_s, 3),
        tokens_per_s_after=round(decision.tokens_per_s, 3),
        shares={share_key(i, g): g.share for i, g in enumerate(new.rollout.replicas)},
    )
    return replace(new, changes=[*running.changes, change])


class Restart(Exception):  # noqa: N818 (a request, as StopIteration is)
    """The run stopped after the recover checkpoint of global step ``step`` to go on on the plan at
    ``plan_file`` with the refit profile at ``profile_file``."""

    def __init__(self, plan_file: str, profile_file: str, step: int, change: PlanChange) -> None:
        super().__init__(
            f"re-planned at the recover checkpoint after step {step + 1}: going on on {plan_file}"
        )
        self.plan_file, self.profile_file, self.step, self.change = plan_file, profile_file, step, change


def restart_args(argv: Sequence[str], plan_file: str, profile_file: str) -> list[str]:
    """The driver's arguments ``argv`` with ``hex.plan_path`` and ``hex.calibration.profile`` set to these files."""
    dropped = ("hex.plan_path=", "hex.calibration.profile=")
    kept = [a for a in argv if not a.lstrip("+").startswith(dropped)]
    return [*kept, f"hex.plan_path={plan_file}", f"hex.calibration.profile={profile_file}"]


class _Always:
    """Upstream's checkpoint frequency control, counting as ever, that says yes this once."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def check(self, *args, **kwargs) -> bool:
        self._inner.check(*args, **kwargs)
        return True


@contextmanager
def forced_dump(recover_handler) -> Iterator[None]:
    """Within the block, upstream's ``RecoverHandler.dump`` writes its checkpoint whatever ``recover.freq_*``
    say (its frequency control still counts the step)."""
    inner = recover_handler.freq_ctl
    recover_handler.freq_ctl = _Always(inner)
    try:
        yield
    finally:
        recover_handler.freq_ctl = inner
