"""Which nodes are slow, from the steps their ranks tell (``meshkit.progress``), pure: what
status, top and the supervisor share.

A node's pace is its slowest rank's compute seconds per step over the window (the time inside
``meshkit.progress.compute()``, which excludes waiting in collectives: in a synchronous job every
rank's step takes as long as the slowest's, so only the computation tells who is slow). A node at
least ``ratio`` times the median of the nodes' paces is a straggler. A job whose ranks time no
compute sections cannot be attributed: its own step time against its first minutes is all there
is to tell (``slowdown``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .protocol import RankProgress, Straggler


def node_pace(progress: Sequence[RankProgress]) -> float | None:
    """A node's compute seconds per step over the window: its slowest rank's (None: no rank
    of it timed compute sections over a window yet)."""
    paces = [rank.compute_s for rank in progress if rank.compute_s is not None]
    return max(paces) if paces else None


def stragglers(nodes: Mapping[str, Sequence[RankProgress]], ratio: float) -> list[Straggler]:
    """The nodes at least ``ratio`` times the median pace, slowest first; none unless at least
    two nodes have a pace to compare (a median of one node is itself)."""
    paces = {}
    for node, progress in nodes.items():
        pace = node_pace(progress)
        if pace is not None:
            paces[node] = pace
    if len(paces) < 2:
        return []
    median = statistics.median(paces.values())
    if median <= 0:
        return []
    found = []
    for node, pace in paces.items():
        if pace >= ratio * median:
            found.append(Straggler(node, pace / median, pace, median))
    found.sort(key=lambda straggler: -straggler.ratio)
    return found


@dataclass(frozen=True)
class Slowdown:
    """A job's step time against its first minutes, unattributed (no compute sections)."""

    ratio: float  # the median rank's step time over the window, over its first minutes'
    seconds: float
    early: float

    def words(self) -> str:
        now = f"{self.seconds * 1000:.0f} ms"
        early = f"{self.early * 1000:.0f} ms"
        why = "no compute sections: not attributed to a node"
        return f"step time {self.ratio:.2f}x the job's first minutes ({now}, {early}; {why})"


def slowdown(progress: Sequence[RankProgress]) -> Slowdown | None:
    """The job's pace over the window against its first minutes, when both are known (None:
    not yet, or the ranks time compute sections, which ``stragglers`` attributes)."""
    if any(rank.compute_s is not None for rank in progress):
        return None
    now = [rank.step_s for rank in progress if rank.step_s is not None]
    early = [rank.early_step_s for rank in progress if rank.early_step_s is not None]
    if not now or not early:
        return None
    seconds = statistics.median(now)
    first = statistics.median(early)
    if first <= 0:
        return None
    return Slowdown(seconds / first, seconds, first)
