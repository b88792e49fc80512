"""Each node's result of a phase run on every node at once, and that phase's progress.

Standard library only: the ops layer and the CLI use these types without importing SSH (the
``remote`` package, which imports paramiko, produces them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One host's result: its value, or the exception it raised with that exception described."""

    value: T | None = None
    exc: BaseException | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def succeeded(results: dict[K, Outcome[T]]) -> dict[K, T]:
    """The items whose call returned, with their values."""
    values = {key: outcome.value for key, outcome in results.items() if outcome.error is None}
    return values  # type: ignore[return-value]  # None only where the call's type allows it


def failed(results: dict[K, Outcome[T]]) -> dict[K, str]:
    """The items whose call failed, with the readable reason."""
    reasons = {}
    for key, outcome in results.items():
        if outcome.error is not None:
            reasons[key] = outcome.error
    return reasons


@dataclass(frozen=True)
class PhaseEvent:
    """A phase's progress: sent after each item, and once more with ``finished`` at the end."""

    phase: str
    done: int
    total: int
    failed: int
    elapsed: float
    finished: bool


ProgressFn = Callable[[PhaseEvent], None]
