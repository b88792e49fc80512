"""What the leading supervisor makes of the steps a job's ranks tell (``meshkit.progress``):
whether the job reports steps and whether this attempt made one (``made_step``: the crash-loop
rule, ``eviction.judge``, counts an attempt that made no step as a failed start), and its
stragglers (``meshkit.stragglers``): a node that stays at least ``--straggler-ratio`` slower
than the median for ``HOLD`` of the window is named in the record (status shows it) and in the
events, and stays named until it was fast again for a whole window; with ``--evict-stragglers``
it is evicted as an unhealthy node is (a spare takes its rank at a relaunch from the last
checkpoint; no restart used). A job without compute sections gets its slowdown against its
first minutes named once, unattributed. The leader's memory only: a new leader starts counting
again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..events import EventKind
from ..hostfile import rank_of
from ..protocol import JobState, RankProgress, RestartReason, Straggler, Supervision
from ..record import replace
from ..stragglers import slowdown, stragglers
from . import jobs as ops
from .eviction import can_evict, replace_call
from .pool import NodePool
from .relaunch import Loop
from .supervision import write
from .supervision_policy import Action, Call, Cause, Decision

# of the straggler window: how long a node must stay slow before it is named. Short: its figure is
# already an average over the window, whose slow steps must outweigh its fast ones to cross the
# ratio (a node 3.5x slow crosses 2x once about 70% of the window is slow)
HOLD = 0.1


@dataclass
class Pace:
    """The leader's memory of the job's steps across its polls."""

    reports: bool = False  # some attempt's ranks told their steps
    attempt: int = -1  # the attempt ``stepped`` and ``since`` belong to
    stepped: bool = False  # this attempt made a step
    since: dict[str, float] = field(default_factory=dict)  # node -> when first seen slow
    named: dict[str, Straggler] = field(default_factory=dict)  # node -> as last seen, named
    fine: dict[str, float] = field(default_factory=dict)  # named node -> when seen fast again
    slowed: bool = False  # this attempt's unattributed slowdown was named

    def see(self, attempt: int, rows: Sequence[ops.StatusRow]) -> None:
        """One poll's rows of ``attempt``."""
        if attempt != self.attempt:
            self.attempt = attempt
            self.stepped = False
            self.since.clear()
            self.named.clear()
            self.fine.clear()
            self.slowed = False
        for row in rows:
            if row.progress:
                self.reports = True
            if any(rank.step > 0 for rank in row.progress):
                self.stepped = True

    def made_step(self) -> bool | None:
        """Whether this attempt made a step (None: the job reports no steps, so a failed start
        is one that failed within config crash_window)."""
        if self.reports:
            return self.stepped
        return None


def slow_nodes(loop: Loop, pace: Pace, rows: Sequence[ops.StatusRow]) -> list[Straggler]:
    """The running members named stragglers, slowest first: one is named once it stayed slow
    for ``HOLD`` of the window, and stays named until it was fast again for a whole window, so
    a node near the ratio is not named and un-named at every other poll."""
    running = [row for row in rows if row.state == JobState.RUNNING and not row.error]
    progress: dict[str, Sequence[RankProgress]] = {row.host: row.progress for row in running}
    found = {found.node: found for found in stragglers(progress, loop.job.straggler_ratio)}
    now = time.monotonic()
    window = loop.job.straggler_window
    for node in list(pace.since):
        if node not in found:
            del pace.since[node]
    for node, straggler in found.items():
        first = pace.since.setdefault(node, now)
        pace.fine.pop(node, None)
        if node in pace.named or now - first >= HOLD * window:
            pace.named[node] = straggler
    for node in list(pace.named):
        if node in found:
            continue
        fast = pace.fine.setdefault(node, now)
        if now - fast >= window:
            del pace.named[node]
            del pace.fine[node]
    return sorted(pace.named.values(), key=lambda straggler: -straggler.ratio)


def watch_pace(
    loop: Loop, pool: NodePool, pace: Pace, call: Call, rows: Sequence[ops.StatusRow]
) -> Call:
    """A poll that found nothing to do (WAIT) looked at for stragglers: each one named (the
    record's ``stragglers``, written when they change, and an event), and with
    ``--evict-stragglers`` the slowest evicted where a spare or a shrink can take its rank."""
    if call.decision.action != Action.WAIT:
        return call
    _name_slowdown(loop, pace, rows)
    held = slow_nodes(loop, pace, rows)
    kept = _named(loop, pool, call.kept, held)
    if loop.job.evict_stragglers and held:
        slowest = held[0]
        hosts = [host for host in loop.hosts if host.label == slowest.node]
        if can_evict(loop, kept, hosts):
            text = f"a straggler: {slowest.why()} (--evict-stragglers)"
            why = f"{slowest.node}: {text}"
            decision = Decision(Action.EVICT, Cause.STRAGGLER, why, RestartReason.EVICTED)
            return replace_call(call, decision, kept, {slowest.node: text})
    return replace_call(call, call.decision, kept)


def _named(
    loop: Loop, pool: NodePool, record: Supervision, held: Sequence[Straggler]
) -> Supervision:
    """The record naming ``held`` (written, with an event per newly named node, only when the
    named nodes change; a node no longer slow is un-named)."""
    before = {straggler.node for straggler in record.stragglers}
    now = {straggler.node for straggler in held}
    if before == now:
        return record
    for straggler in held:
        if straggler.node not in before:
            loop.say(f"straggler: {straggler.words()}")
            rank = rank_of(loop.hosts, straggler.node)
            loop.tell(EventKind.STRAGGLER, straggler.words(), straggler.node, rank)
    for node in before - now:
        loop.say(f"{node} is no longer a straggler")
    named = replace(record, stragglers=list(held))
    written = write(pool, loop.job, loop.hosts, named, loop.me, False, loop.quorum)
    return named if written is None else written


def _name_slowdown(loop: Loop, pace: Pace, rows: Sequence[ops.StatusRow]) -> None:
    """A job without compute sections whose step time rose ``--straggler-ratio`` over its first
    minutes: named once an attempt, unattributed (no node can be blamed for it)."""
    if pace.slowed:
        return
    progress = [rank for row in rows if row.state == JobState.RUNNING for rank in row.progress]
    found = slowdown(progress)
    if found is None or found.ratio < loop.job.straggler_ratio:
        return
    pace.slowed = True
    loop.say(f"slower: {found.words()}")
    loop.tell(EventKind.STRAGGLER, found.words())
