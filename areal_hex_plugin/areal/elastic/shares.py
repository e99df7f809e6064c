"""Rollout shares over the servers that serve: re-solved by the planner's rollout model whenever a server leaves
or comes, or the lengths they serve move (``planner/reshare.py``: milliseconds, no re-plan)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from areal_hex_plugin.costmodel import CostModel
from areal_hex_plugin.planner.reshare import RESOLUTION, ServerShape, reshare, reshare_gain


class SharePolicy:
    """The servers' shapes, the cost model their shares are solved with, and the shares the router holds."""

    def __init__(
        self,
        cost_model,
        shapes: Sequence[ServerShape],
        set_shares: Callable[[Sequence[float]], None],
        window: int = 1,
    ) -> None:
        self.cm = cost_model  # its lengths are the ones the shares were solved for
        self.shapes = list(shapes)
        self.window = window  # the plan's update window, which re-shares score
        self.shares: tuple[float, ...] = ()
        self._set_shares = set_shares
        self.reshares = 0

    def apply(self, shares: Sequence[float]) -> None:
        """Hand ``shares`` to the router."""
        self.shares = tuple(shares)
        self._set_shares(shares)
        self.reshares += 1

    def resolve(self, live: Sequence[bool]) -> None:
        """Re-solve the shares over the ``live`` servers (none live: nothing changes)."""
        if any(live):
            self.apply(reshare(self.cm, self.shapes, live, window=self.window).shares)

    def recalibrate(
        self, calibration, live: Sequence[bool], min_gain: float = 0.0, moved: float = 1e-3
    ) -> bool:
        """Solve shares under ``calibration`` from now on (an online refit; the lengths stay the ones the shares
        were solved for), handed to the router when they differ from the ones the model before gives by more
        than ``moved`` for any server (the plan's own shares, rounded to whole samples, are not a change) and,
        under ``calibration``, generate more than ``min_gain`` faster than the shares held now (a refit's noise
        moves no share)."""
        was, self.cm = self.cm, CostModel(self.cm.cluster, self.cm.workload, calibration)
        if not any(live):
            return False
        before = reshare(was, self.shapes, live, window=self.window).shares
        solved = reshare(self.cm, self.shapes, live, window=self.window)
        if all(abs(a - b) <= moved for a, b in zip(solved.shares, before, strict=True)):
            return False
        if reshare_gain(self.cm, self.shapes, live, self.shares, solved, self.window) <= min_gain:
            return False
        self.apply(solved.shares)
        return True

    def add(self, shape: ServerShape) -> None:
        """A server that joins: share 0 until it serves."""
        self.shapes.append(shape)
        self.shares = (*self.shares, 0.0)

    def tokens_per_s(self, live: Sequence[bool]) -> float:
        """Predicted generation speed of the ``live`` servers (a split's samples per second, in tokens)."""
        if not any(live):
            return 0.0
        result = reshare(self.cm, self.shapes, live, window=self.window)
        return RESOLUTION * self.cm.workload.output_lengths.mean / result.makespan_s
