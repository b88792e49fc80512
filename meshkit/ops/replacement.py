"""A supervised job's replacement step (``train --replace-after``), the supervisor's REPLACE
action once nodes are lost: each lost rank to the first spare that answers, gets the workdir (a
synced job) and passes the doctor's quick checks, or with too few such spares and
``--min-nodes`` the job shrunk (``ops.membership.plan``); the new generation claimed on every node
of it and on a majority of the job's nodes (``quorum``), then made as any claimed attempt is
(``ops.relaunch.finish``). With neither possible, it waits up to ``--replace-after`` more for the
nodes or a spare, then gives up saying why. Also the note the record carries while the leader
waits for nodes (``waiting_note``). A lost node that comes back is fenced (``ops.fencing``). A
replacement uses up no restart.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import LaunchError, RemoteError
from ..events import EventKind
from ..hostfile import Host, members_text
from ..job import Job
from ..protocol import RestartReason, StopReply, StopRequest, Supervision, SupervisorState
from ..quorum import majority
from ..record import replace
from . import jobs as ops
from .membership import Change, plan, reason_of_change, spares_of
from .pool import NodePool
from .relaunch import Loop, finish
from .supervision import write
from .supervision_policy import Final, Outcome, Then, held_by
from .verdicts import Check

RECONNECT = 10.0  # seconds between new connections while some node does not answer


@dataclass(frozen=True)
class Refused:
    """Spares a change of membership could not use, each with why (down, sync, checks)."""

    spares: dict[Host, str]


def replace_lost(loop: Loop, seen: Supervision, lost: list[Host], bound: float) -> Outcome:
    """``lost`` did not answer within ``bound`` (--replace-after): a new membership without
    them, claimed on every node of it and launched. With none possible, try again (a spare
    refused a while ago may be healthy now) until ``bound`` more has passed, then give up
    saying why; back to watching should every node answer again meanwhile."""
    names = ", ".join(host.label for host in lost)
    loop.say(f"lost: {names} (no answer within {bound:.0f}s, --replace-after)")
    for host in lost:
        text = f"{host.label} lost: no answer within {bound:.0f}s (--replace-after)"
        loop.tell(EventKind.LOST, text, host.label, loop.hosts.index(host))
    deadline = time.monotonic() + bound
    refused: dict[Host, str] = {}
    while True:
        loop.moved()
        spares = spares_of(loop.cluster, loop.hosts, seen.evicted)
        candidates = [host for host in spares if host not in refused]
        change = plan(loop.hosts, lost, candidates, loop.cluster, loop.job.min_nodes)
        if change is not None:
            tried = try_change(loop, seen, change)
            if isinstance(tried, Refused):
                for spare, why in tried.spares.items():
                    loop.say(f"spare {spare.label} not used: {why}")
                refused.update(tried.spares)
                continue
            return tried
        if time.monotonic() > deadline:
            why = unreplaced(loop, seen, names, bound, refused)
            with loop.connect(loop.hosts, 0.0) as pool:
                codes = end_what_is_left(pool, loop.job, loop.hosts)
                return loop.gave_up(pool, replace(seen, exit_codes=codes), why)
        every = [*loop.hosts, *(host for host in loop.cluster if host not in loop.hosts)]
        with loop.connect(every, RECONNECT) as pool:
            if not any(host in pool.failures for host in loop.hosts):
                loop.say("every node answers again; back to watching")
                return Then.WATCH
            answering = [host for host in every if host not in pool.failures]
            if loop.quorum and len(answering) < majority(len(every)):
                loop.say(unclaimed(pool, every, []))
                return Then.WATCH  # the watch acts on nothing without a majority
        refused.clear()  # a spare refused a while ago may be healthy now
        time.sleep(loop.interval)


def unreplaced(
    loop: Loop, seen: Supervision, names: str, bound: float, refused: dict[Host, str]
) -> str:
    """Why the job gives up on its lost nodes ``names``: no spare took their place."""
    why = f"{seen.last_restart_reason}; then {names} did not answer within "
    why += f"{bound:.0f}s (--replace-after) and no healthy spare took its place"
    if refused:
        spares = "; ".join(f"{host.label}: {text}" for host, text in refused.items())
        why += f" (spares: {spares})"
    elif not spares_of(loop.cluster, loop.hosts, seen.evicted):
        why += " (the hostfile has no spare line)"
    if loop.job.min_nodes is not None:
        why += f", and fewer than --min-nodes {loop.job.min_nodes} nodes are left"
    return why


def try_change(loop: Loop, seen: Supervision, change: Change) -> Outcome | Refused:
    """Make ``change`` over the nodes of the new membership: each spare taking a rank must
    answer, get the workdir (a synced job) and pass the doctor's quick checks; then the new
    generation is claimed on every node of it and launched (an evicted node's part ended
    first). ``Refused``: spares it could not use; ``Then.WATCH``: back to watching (another
    supervisor moved on, or a member is down too)."""
    labels = tuple(host.label for host in change.members)
    claim = claim_of(seen, change, loop.above)
    job = replace(loop.job, members=labels, generation=claim.generation)
    # the lost nodes count against the majority, but are not waited for once more (an evicted
    # node answers: it is asked, and its part of the job ended)
    gone = [host for host in change.lost if host not in change.evicted]
    others = [host for host in loop.cluster if host not in change.members and host not in gone]
    with loop.connect([*change.members, *others], RECONNECT) as pool:
        down = {host: pool.failures[host] for host in change.added if host in pool.failures}
        if down:
            return Refused(down)
        if any(host in pool.failures for host in change.members):
            return Then.WATCH
        if job.sync:
            from .sync import sync_workdir

            try:
                sync_workdir(pool, job, change.added)
            except (LaunchError, RemoteError) as exc:
                why = str(exc).replace("\n", "; ")
                return Refused({host: f"sync failed: {why}" for host in change.added})
        for where in job.home_copies(change.members):
            pool.write_file(where, job.node_hostfile, members_text(change.members))
        held = loop.gate(pool, job, change.members)
        unfit = unfit_spares(change.added, held)
        if unfit:
            return Refused(unfit)
        # the claim's ``by`` finishes it; a leader evicting its own node is in no rank of
        # it: rank 0's supervisor, or the new membership's leader, takes it over (RESUME)
        rank = 0
        if loop.node in change.members:
            rank = change.members.index(loop.node)
        claimed = write(pool, job, change.members, claim, rank, True, loop.cluster, gone)
        if claimed is None:
            loop.say(unclaimed(pool, loop.cluster, gone))
            return Then.WATCH
        loop.say(f"generation {claimed.generation}: {claimed.last_restart_reason}")
        out = [host for host in change.evicted if host not in pool.failures]
        if out:  # its supervisor is fenced by the new generation; its part ends now
            ending = StopRequest(loop.job.id)
            pool.call_all("stop", lambda host: ending, StopReply, out)
        tell_change(loop, change, claimed)
        if loop.node not in change.members:
            loop.say("this node is evicted: the new membership's supervisors launch the claim")
            return Final(claimed)
        loop.follow(claimed)
        # the checks just passed on every node of it: not run again before the launch
        return finish(loop, pool, claimed, checked=not held)


def tell_change(loop: Loop, change: Change, claimed: Supervision) -> None:
    """The events of a change of membership that stands: each replacement, a shrink."""
    for line in change.replaced:
        lost, _, spare = line.partition(" -> ")
        rank = [host.label for host in change.members].index(spare)
        text = f"{spare} takes rank {rank} of {lost} (generation {claimed.generation})"
        why = [reason for host, reason in change.evicted.items() if host.label == lost]
        if why:
            text += f": {lost} evicted, {why[0]}"
        loop.tell(EventKind.REPLACED, text, spare, rank, attempt=claimed.attempt)
    if change.reason == RestartReason.SHRUNK:
        text = f"shrunk to {len(change.members)} nodes (generation {claimed.generation}): "
        text += str(claimed.last_restart_reason)
        loop.tell(EventKind.SHRUNK, text, attempt=claimed.attempt)


def unclaimed(pool: NodePool, cluster: Sequence[Host], lost: Sequence[Host]) -> str:
    """Why a claim of a new generation did not stand: too few of the job's nodes answer for a
    majority (a partition; ``lost``: not asked), or another supervisor moved on first."""
    answering = [host for host in cluster if host not in pool.failures and host not in lost]
    if len(answering) < majority(len(cluster)):
        return (
            f"no majority of the job's nodes answers ({len(answering)} of {len(cluster)}): "
            "partitioned? launching nothing on this side"
        )
    return (
        "another supervisor moved on first, or a majority of the job's nodes did not keep "
        "the claim; following it"
    )


def unfit_spares(added: Sequence[Host], held: Sequence[Check]) -> dict[Host, str]:
    """Pure: the spares of ``added`` that failed one of the checks ``held``, each with its
    first failed check ("NODE: CHECK: DETAIL")."""
    unfit = {}
    for spare in added:
        failed = [check for check in held if check.node == spare.label]
        if failed:
            unfit[spare] = held_by(failed[0])
    return unfit


def claim_of(seen: Supervision, change: Change, above: int = 0) -> Supervision:
    """Pure: the claim of ``change``'s generation over the record ``seen``: the next attempt,
    on the new membership, with the lost nodes and the replacements added to the record's and
    no restart used up. Its generation is past ``above`` too (``quorum.past_unproven``). An
    evicted node is kept out (``evicted``), not lost, and no longer unhealthy-without-a-spare."""
    lost = [host.label for host in change.lost if host not in change.evicted]
    out = [f"{host.label}: {why}" for host, why in change.evicted.items()]
    named = {host.label for host in change.evicted}
    unhealthy = [line for line in seen.unhealthy if line.split(": ", 1)[0] not in named]
    return replace(
        seen,
        supervisor=SupervisorState.RELAUNCHING,
        attempt=seen.attempt + 1,
        reason=change.reason,
        generation=max(seen.generation, above) + 1,
        members=[host.label for host in change.members],
        lost=[*seen.lost, *lost],
        evicted=[*seen.evicted, *out],
        unhealthy=unhealthy,
        quick=[] if out else seen.quick,  # an eviction ends the failed starts' run
        replaced=[*seen.replaced, *change.replaced],
        last_restart_reason=reason_of_change(change),
        waiting=None,
        held=None,
    )


def end_what_is_left(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[int | None]:
    """The job cannot go on without its lost nodes: end it on the nodes that answer (its
    ranks wait on their lost peers), keeping the codes they end with; each node's code."""
    left = [host for host in hosts if host not in pool.failures]
    ending = StopRequest(job.id, keep_exit=True)
    pool.call_all("stop", lambda host: ending, StopReply, left)
    return [row.exit_code for row in ops.status(pool, job, hosts, phase="")]


def waiting_note(names: Sequence[str], until: float, replace_after: float | None) -> str:
    """Pure: what the record says while the leader waits for the nodes ``names`` (status
    shows it): until when (``until``: a wall-clock time), and what happens then."""
    stamp = datetime.datetime.fromtimestamp(until, datetime.timezone.utc)
    what = "lost then (--replace-after)"
    if replace_after is None:
        what = "given up then"
    return f"{', '.join(names)} until {stamp:%H:%M:%S} UTC, {what}"
