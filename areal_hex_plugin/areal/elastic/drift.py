"""Length drift: each step's served output lengths against the lengths the shares were solved for.

When they move the predicted rollout time of a window's samples by more than ``drift_threshold``, the shares are
re-solved with the measured lengths, the lengths are written out for ``hex.workload.output_lengths: {kind: file}``,
and a re-plan suggestion is logged: the planner's plan for the measured lengths (solved off the training thread),
the machines it would move and its predicted gain.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from areal.utils import logging

from areal_hex_plugin.planner.reshare import RESOLUTION, Drift, ServerShape, drift

logger = logging.getLogger("HexElastic")


class DriftAdvisor:
    """Scores served lengths for drift, and suggests a re-plan for them."""

    def __init__(
        self,
        threshold: float,
        min_samples: int,
        samples: int = RESOLUTION,
        window: int = 1,
        lengths_file: str | None = None,
        suggest: Callable[[Any], Any] | None = None,
    ) -> None:
        self.threshold, self.min_samples = threshold, min_samples
        self.samples = samples  # a window's samples: drift is scored on their rollout time
        self.window = window
        self.change = 0.0
        self.suggested_gain: float | None = None
        self._lengths_file = lengths_file
        self.suggest = suggest  # workload -> replan.LengthSuggestion (a solve: run off the training thread)

    def check(
        self, cm, shapes: Sequence[ServerShape], live: Sequence[bool], lengths: list[int], step: int
    ) -> Drift | None:
        """The drift of a step's served ``lengths``, if there are enough of them to score; ``change`` follows."""
        if len(lengths) < self.min_samples or not any(live):
            return None
        found = drift(cm, shapes, live, lengths, f"served at step {step}", self.samples, self.window)
        self.change = found.change
        return found

    def moved(self) -> bool:
        """Whether the last drift scored passes the threshold."""
        return abs(self.change) > self.threshold

    def advise(self, found: Drift, lengths: list[int]) -> None:
        """Write the served lengths out and log the planner's suggestion for them (on a thread of its own)."""
        written = ""
        if self._lengths_file:
            Path(self._lengths_file).write_text("".join(f"{n}\n" for n in lengths))
            written = f" (written to {self._lengths_file})"
        if self.suggest is not None:
            threading.Thread(
                target=self._log_suggestion,
                args=(found.measured.workload, written),
                name="hex-replan",
                daemon=True,
            ).start()

    def _log_suggestion(self, workload, written: str) -> None:
        """What a re-plan for the served lengths would change and gain (the planner's search)."""
        try:
            found = self.suggest(workload)
        except Exception as error:  # a suggestion only: the run goes on
            logger.warning(f"no re-plan suggestion for the served lengths ({error})")
            return
        self.suggested_gain = found.gain
        figures = (
            f"the planner's plan for them predicts {found.tokens_per_s:,.1f} tokens/s against about "
            f"{found.current_tokens_per_s:,.1f} for the running plan at these lengths ({found.gain:+.1%})"
        )
        if not found.diff:
            logger.info(
                f"re-plan suggestion: none, the layout stays ({figures}); the re-balanced shares suffice"
            )
            return
        moves = "; ".join(f"{d.host}: {d.before or '(new)'} -> {d.after or '(gone)'}" for d in found.diff)
        logger.warning(
            f"re-plan suggestion for the served lengths: {figures}, moving {len(found.diff)} machines ({moves}). "
            f"Plan the recipe with hex.workload.output_lengths={{kind: file, path: <the served lengths>{written}}} "
            "(areal-hex plan RECIPE --json PLAN.json) and resume from the recover checkpoint with hex.plan_path"
        )
