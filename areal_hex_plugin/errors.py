"""The one error type a user sees: it names the field, says what is wrong and how to fix it."""

from __future__ import annotations


class HexError(Exception):
    """Bad user input (recipe, inventory, plan, command line).

    The CLI prints ``str(error)`` and exits with code 2, without a traceback.
    """

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        text = f"{self.field}: {self.problem}" if self.field else self.problem
        return f"{text}\n  fix: {self.fix}" if self.fix else text


class UpstreamLimit(HexError):
    """A plan or config that upstream AReaL (as the plugin drives it) cannot start; refused before any worker."""
