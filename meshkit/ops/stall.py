"""When a running job counts as stalled, pure: what status, top, diagnose and the supervisor
share. A job whose ranks tell their steps (``meshkit.progress``) stalls by them: a running rank
whose last step is ``job.step_stall_after`` old; its output then says nothing (a rank may print
and make no step, or step in silence). Any other job stalls by its output: every running node's
log unwritten for ``job.stall_after``, each by its own clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..hostfile import Host, rank_of
from ..job import Job
from ..protocol import JobState, RankProgress


@dataclass(frozen=True)
class Watched:
    """One node that answered, as a stall is judged on it."""

    host: str
    state: JobState | None
    idle_s: float | None  # seconds since its log was written
    progress: Sequence[RankProgress]  # its ranks' steps, if told


@dataclass(frozen=True)
class Stalled:
    """Why a job counts as stalled, and the rank and node whose last step is the oldest (None:
    a stall by output, which names no node)."""

    words: str
    node: str | None = None
    rank: int | None = None


def is_stalled(stall_after: float | None, nodes: Sequence[tuple[str, float | None]]) -> bool:
    """A running job none of whose running nodes has written output for ``stall_after``
    seconds (each node's log, by its own clock). ``nodes``: (state, idle seconds)."""
    running = [idle for state, idle in nodes if state == JobState.RUNNING]
    if stall_after is None or not running:
        return False
    return all(idle is not None and idle >= stall_after for idle in running)


def stall(job: Job, nodes: Sequence[Watched]) -> Stalled | None:
    """Why the running job counts as stalled (None: it does not), naming the rank, its node and
    its last step, or the output's silence."""
    running = [node for node in nodes if node.state == JobState.RUNNING]
    told = [(node, rank) for node in running for rank in node.progress]
    if told:
        if job.step_stall_after is None:
            return None
        node, rank = max(told, key=lambda pair: pair[1].age)
        if rank.age < job.step_stall_after:
            return None
        last = f"no step for {rank.age:.0f}s (its step {rank.step})"
        bound = f"--stall-after {job.step_stall_after:.0f}s"
        return Stalled(f"rank {rank.rank} on {node.host}: {last}, {bound}", node.host, rank.rank)
    answered = [(str(node.state), node.idle_s) for node in nodes]
    if job.stall_after is None or not is_stalled(job.stall_after, answered):
        return None
    return Stalled(f"no output for {job.stall_after:.0f}s (--stall-after)")


def stalled_at(
    found: Stalled | None, outliers: Sequence[str], hosts: Sequence[Host]
) -> tuple[str | None, int | None]:
    """The node a stall is named on, and its rank in ``hosts``: the one node whose ranks'
    stacks stand out (the diagnosis' outliers: a hung rank is not where its peers wait), else
    the node of the oldest last step, else none (a stall by output names no node)."""
    node = None
    if len(outliers) == 1:
        node = outliers[0]
    elif found is not None:
        node = found.node
    if node is None:
        return None, None
    return node, rank_of(hosts, node)
