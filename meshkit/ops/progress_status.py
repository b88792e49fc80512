"""The steps a job's ranks tell (``meshkit.progress``) as ``status`` and ``top`` show them: each
node's step, rate and age in a few words, each rank's ``--json`` object, and the stragglers
named: a supervised job's as its leader wrote them in the record (the supervisor's verdict,
which an eviction follows), else this poll's (``meshkit.stragglers``). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..protocol import RankProgress, Straggler
from ..stragglers import stragglers


@dataclass(frozen=True)
class NodeSteps:
    """One node's steps: a synchronous job is as far as its slowest rank."""

    step: int  # its ranks' lowest
    rate: float | None  # its slowest rank's steps per second over the window (None: not yet)
    age: float  # seconds since the oldest of its ranks' last steps

    def words(self) -> str:
        """``1234 2.1/s 0s ago``; ``1234 0s ago`` before the window has a rate."""
        rate = "" if self.rate is None else f" {self.rate:.1f}/s"
        return f"{self.step}{rate} {self.age:.0f}s ago"


def node_steps(progress: Sequence[RankProgress]) -> NodeSteps | None:
    """A node's steps from its ranks' (None: none of them tells its steps)."""
    if not progress:
        return None
    rates = [rank.rate for rank in progress if rank.rate is not None]
    lowest = min(rank.step for rank in progress)
    oldest = max(rank.age for rank in progress)
    return NodeSteps(lowest, min(rates) if rates else None, oldest)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def rank_json(rank: RankProgress) -> dict[str, object]:
    """One rank's ``progress`` object in ``status --json``."""
    return {
        "rank": rank.rank,
        "step": rank.step,
        "age": round(rank.age, 1),
        "rate": _rounded(rank.rate, 3),
        "step_s": _rounded(rank.step_s, 4),
        "compute_s": _rounded(rank.compute_s, 4),
    }


def straggler_json(straggler: Straggler | None) -> dict[str, object] | None:
    """A node's ``straggler`` in ``status --json`` and ``top --json`` (None: it is not one)."""
    if straggler is None:
        return None
    return {
        "ratio": round(straggler.ratio, 2),
        "compute_s": round(straggler.seconds, 4),
        "median_s": round(straggler.median, 4),
    }


@dataclass(frozen=True)
class Named:
    """The stragglers status names: its lines below the table, and each named node's figures."""

    lines: list[str] = field(default_factory=list)
    nodes: dict[str, Straggler] = field(default_factory=dict)


def named(
    nodes: Mapping[str, Sequence[RankProgress]],
    ratio: float,
    record: Sequence[Straggler] | None,
) -> Named:
    """The stragglers among ``nodes`` (each node's ranks' progress): ``record``'s when a
    supervisor judges them (None: none does), else this poll's against ``ratio``."""
    found = list(record) if record is not None else stragglers(nodes, ratio)
    lines = [straggler.words() for straggler in found]
    return Named(lines, {straggler.node: straggler for straggler in found})
