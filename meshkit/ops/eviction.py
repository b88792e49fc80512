"""A supervised job's broken nodes: what a poll makes of its members' health and of a failure
(``judge``: a member whose health evicts it, the failure's cause record and the node it counts
against, a lemon, a crash loop), and the EVICT action (``evict_nodes``): the nodes put out of
the job for good (until ``train --readmit``), each rank to a healthy spare or the job shrunk
(``membership.evict``), claimed and made as a replacement is (``replacement.try_change``), and
no restart used. A node no spare can replace is noted in the record (``unhealthy``), named in
status and the events, and the job goes on on it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..events import Blame, EventKind
from ..health import HealthState, NodeHealth
from ..hostfile import Host, rank_of
from ..protocol import RestartReason, Supervision
from ..record import replace
from . import jobs as ops
from .attribution import blame, blame_words, lemon
from .diagnose import diagnose
from .membership import evict, spares_of
from .pool import NodePool
from .relaunch import Loop
from .replacement import Refused, try_change
from .supervision import write
from .supervision_policy import (
    Action,
    Call,
    Cause,
    Decision,
    NodeView,
    Outcome,
    Then,
    crashed,
    evictable,
    failed_start,
    restartable,
)

LOG_LINES = 10  # of the first-failing node's log, in its failure's cause record
NOT_HELPING = "restarting is not helping"


def judge(
    loop: Loop,
    pool: NodePool,
    call: Call,
    rows: Sequence[ops.StatusRow],
    started: dict[int, float],
    stepped: bool | None = None,
) -> Call:
    """What a poll's ``call`` becomes once its members' health and its failure's cause are
    known: EVICT an unhealthy member (no restart used) where a spare or a shrink can take its
    rank, else note it; for a failure, its cause record (an event) and, counted against its
    node, a lemon's EVICT; a crash loop's GIVE_UP. DONE and REPLACE stand as they are.
    ``stepped``: whether the attempt made a step (None: the job reports none), which decides
    a failed start for a job that reports steps."""
    if call.decision.action in (Action.DONE, Action.REPLACE):
        return call
    # first the members' health: a node that cannot be trusted is not relaunched on
    health = {row.node_rank: row.health for row in rows if not row.error}
    kept = mended(loop, pool, call.kept, call.nodes, health)
    out = evictable(call.nodes, health, loop.job.evict, [*kept.unhealthy, *kept.evicted])
    if out:
        hosts = [host for host in loop.hosts if host.label in out]
        if can_evict(loop, kept, hosts):
            why = "; ".join(f"{label}: {text}" for label, text in out.items())
            decision = Decision(Action.EVICT, Cause.HEALTH, why, RestartReason.EVICTED)
            return replace_call(call, decision, kept, out)
        kept = note_unhealthy(loop, pool, kept, out)
    # then a failure's cause, the node it counts against, and the run of failed starts
    failing = call.decision.cause in (Cause.FAILURE, Cause.STALL, Cause.REBOOT)
    if not failing or call.decision.action not in (Action.RESTART, Action.GIVE_UP):
        return replace_call(call, call.decision, kept)
    found = cause_of(pool, loop, call.nodes, rows, health)
    rank = found.node_rank
    loop.tell(EventKind.FAILED, blame_words(found), found.node, rank, found)
    if found.attributed and found.node is not None:
        kept = replace(kept, blamed=[*kept.blamed, found.node])
    now = time.time()
    begun = min(started.values(), default=None)
    quick = not stepped  # of a job that reports steps: an attempt that made none
    if stepped is None:
        quick = failed_start(begun, now, loop.job.crash_window)
    if quick:
        kept = replace(kept, quick=[*kept.quick, f"attempt {kept.attempt}: {blame_words(found)}"])
    else:
        kept = replace(kept, quick=[])
    if call.decision.action == Action.GIVE_UP and not spent(call, loop.job.restart_on):
        return replace_call(call, call.decision, kept)  # a fatal code: nothing is evicted
    node = found.node
    if node is not None and lemon(kept.blamed, node, loop.job.evict_after):
        hosts = [host for host in loop.hosts if host.label == node]
        if can_evict(loop, kept, hosts):
            count = kept.blamed.count(node)
            text = f"a lemon: {count} failures attributed to it (--evict-after)"
            decision = Decision(Action.EVICT, Cause.LEMON, f"{node}: {text}", RestartReason.EVICTED)
            return replace_call(call, decision, kept, {node: text})
    if call.decision.action == Action.RESTART and crashed(kept.quick, loop.job.max_failed_starts):
        causes = " | ".join(kept.quick)
        within = f"within {loop.job.crash_window:.0f}s"
        if stepped is not None:
            within = "before their first step"
        why = f"{NOT_HELPING}: {len(kept.quick)} attempts in a row failed {within}: {causes}"
        return replace_call(call, Decision(Action.GIVE_UP, call.decision.cause, why), kept)
    return replace_call(call, call.decision, kept)


def health_changes(
    loop: Loop, healths: dict[str, HealthState], rows: Sequence[ops.StatusRow]
) -> None:
    """A HEALTH event for each node whose health changed since the last poll (``healths``, by
    node; first seen: only when not ok)."""
    for row in rows:
        if row.health is None:
            continue
        before = healths.get(row.host)
        now = row.health.state
        healths[row.host] = now
        if now == before or (before is None and now == HealthState.OK):
            continue
        text = f"{row.host} is {now}"
        if row.health.reasons:
            text += ": " + "; ".join(row.health.reasons)
        loop.tell(EventKind.HEALTH, text, row.host, row.node_rank)


def spent(call: Call, restart_on: Sequence[int]) -> bool:
    """Whether a GIVE_UP is for want of restarts (every failing code restartable): a lemon's
    eviction, which uses none, may still go on."""
    codes = [view.exit_code for view in call.nodes if view.exit_code not in (0, None)]
    return call.kept.restarts_left <= 0 and all(
        restartable(code, restart_on) for code in codes if code is not None
    )


def replace_call(
    call: Call, decision: Decision, kept: Supervision, out: dict[str, str] | None = None
) -> Call:
    return Call(decision, call.record, kept, call.nodes, out or {})


def can_evict(loop: Loop, record: Supervision, hosts: Sequence[Host]) -> bool:
    """Whether ``hosts`` can be put out of the job: some spare (not evicted) could take their
    ranks, or the job could shrink (--min-nodes), as far as is known before asking the spares;
    and only where the membership may change at all (--replace-after)."""
    if not hosts or loop.job.replace_after is None:
        return False
    spares = spares_of(loop.cluster, loop.hosts, record.evicted)
    reasons = dict.fromkeys(hosts, "")
    return evict(loop.hosts, reasons, spares, loop.cluster, loop.job.min_nodes) is not None


def note_unhealthy(
    loop: Loop, pool: NodePool, record: Supervision, out: dict[str, str]
) -> Supervision:
    """Members that should be evicted and cannot be (no healthy spare, no --min-nodes): the
    record says so (status shows it) and the events, once; the job goes on on them."""
    lines = [f"{label}: {why}" for label, why in out.items()]
    for label, why in out.items():
        text = f"{label} is {why}; no healthy spare can take its rank: the job runs on it"
        loop.say(text)
        loop.tell(EventKind.NO_SPARE, text, label, rank_of(loop.hosts, label))
    noted = replace(record, unhealthy=[*record.unhealthy, *lines])
    written = write(pool, loop.job, loop.hosts, noted, loop.me, False, loop.quorum)
    return noted if written is None else written


def mended(
    loop: Loop,
    pool: NodePool,
    record: Supervision,
    nodes: Sequence[NodeView],
    health: dict[int, NodeHealth | None],
) -> Supervision:
    """The record without the notes of members no spare could replace that are no longer to
    be evicted (their health came back): written once, as the note was."""
    still = evictable(nodes, health, loop.job.evict, [])
    asked = {view.host for view in nodes if health.get(view.rank) is not None}
    kept = [
        line
        for line in record.unhealthy
        if line.split(": ", 1)[0] in still or line.split(": ", 1)[0] not in asked
    ]
    if kept == record.unhealthy:
        return record
    loop.say("a member that ran unhealthy with no spare is healthy again")
    mended_record = replace(record, unhealthy=kept)
    written = write(pool, loop.job, loop.hosts, mended_record, loop.me, False, loop.quorum)
    return mended_record if written is None else written


def cause_of(
    pool: NodePool,
    loop: Loop,
    nodes: Sequence[NodeView],
    rows: Sequence[ops.StatusRow],
    health: dict[int, NodeHealth | None],
) -> Blame:
    """A failure's cause record: the ranks' error files (``diagnose``), each node's exit and
    health, then the first-failing node's last log lines."""
    ended = {row.node_rank: row.ended for row in rows if row.ended is not None}
    found = diagnose(pool, loop.job, loop.hosts, stacks=False)
    cause = blame(nodes, ended, health, found.errors)
    if cause.node_rank is None:
        return cause
    chunks = ops.logs(pool, loop.job, loop.hosts, [cause.node_rank], LOG_LINES)
    lines = [line[:300] for chunk in chunks for line in chunk.lines]
    return replace(cause, log=lines[-LOG_LINES:])


def evict_nodes(loop: Loop, call: Call) -> Outcome:
    """EVICT: the nodes the decision names put out of the job, each rank to the first healthy
    spare (the gate refuses an unhealthy one) or the job shrunk; claimed and launched as a
    replacement is, the evicted nodes' part ended once the claim stands. No restart used.
    With no spare left to try, the nodes are noted in the record, and the job goes on."""
    seen = call.kept
    why = call.decision.reason
    out = evicted_by(loop, call)
    loop.say(f"evicting: {why}")
    for host, text in out.items():
        loop.tell(
            EventKind.EVICTED,
            f"{host.label} evicted: {text}",
            host.label,
            rank_of(loop.hosts, host.label),
        )
    refused: dict[Host, str] = {}
    while True:
        loop.moved()
        spares = [
            host
            for host in spares_of(loop.cluster, loop.hosts, seen.evicted)
            if host not in refused
        ]
        change = evict(loop.hosts, out, spares, loop.cluster, loop.job.min_nodes)
        if change is None:
            with loop.connect(loop.hosts, 0.0) as pool:
                note_unhealthy(loop, pool, seen, {host.label: text for host, text in out.items()})
            return Then.WATCH
        tried = try_change(loop, seen, change)
        if not isinstance(tried, Refused):
            return tried
        for spare, text in tried.spares.items():
            loop.say(f"spare {spare.label} not used: {text}")
        refused.update(tried.spares)


def evicted_by(loop: Loop, call: Call) -> dict[Host, str]:
    """The members an EVICT call names, each with why."""
    return {host: call.evict[host.label] for host in loop.hosts if host.label in call.evict}
