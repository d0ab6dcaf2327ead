"""The planner's two errors, in a module of their own so that every stage can raise or catch them
without importing the planner."""

from __future__ import annotations

__all__ = ["PlanError", "MemoryBudgetError"]


class PlanError(ValueError):
    """A plan that does not fit the model, mesh or file it is used with."""


class MemoryBudgetError(ValueError):
    """No plan fits the memory budget; the message states the minimum any plan needs."""

    def __init__(self, message: str, minimum_bytes: float) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
