"""A supervised job's supervision as ``status`` and ``top`` show it: the job-level record beside
the per-node rows (the believed record's fields, the leader, each spare's health), and the one
renderer of the supervisor's words ("running, attempt 2 of 4 (leader: node 0)"). Pure, but for
``spare_rows``, which asks the spares for their facts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .. import protocol as p
from ..hostfile import Host
from ..job import Job
from ..protocol import Straggler, SupervisorShown, SupervisorState
from .health import health_request
from .pool import NodePool, unanswered
from .supervision import View
from .verdicts import clock_check, gpus_check, health_check, versions_check

RUNNING = (SupervisorState.RUNNING, SupervisorState.RELAUNCHING)  # a supervisor is at work
NOT_BACKED = (
    "no node has a live supervisor (each was ended, or its node rebooted); "
    "`meshkit train` relaunches the job under new ones"
)


@dataclass(frozen=True)
class SpareRow:
    """A node of the hostfile outside the job's membership: a spare line, or a lost node that
    came back. ``healthy``: it passes ``spare_rows``' checks; else ``why`` not."""

    node: str
    healthy: bool
    why: str | None = None
    running: bool = False  # it runs the job outside the membership (a partition's other side)


@dataclass(frozen=True)
class SupervisionStatus:
    """A supervised job's supervision, once for the job: its believed record's fields (each None
    or empty when no node keeps a record, e.g. after ``stop``), its leader and its spares."""

    supervisor: SupervisorState | SupervisorShown | None = None  # None: no record
    attempt: int | None = None
    restarts_left: int | None = None
    last_restart_reason: str | None = None
    diagnosis: str | None = None  # the diagnosis the supervisor saved before a stall restart
    leader: int | None = None  # the rank whose supervisor leads (None: no live one)
    held: str | None = None  # what holds a relaunch: "NODE: CHECK: DETAIL"
    generation: int | None = None  # the membership's (one on with each replacement or shrink)
    lost: list[str] = field(default_factory=list)  # nodes dropped from the membership
    replaced: list[str] = field(default_factory=list)  # "LOST -> SPARE"
    waiting: str | None = None  # the nodes a relaunch waits for, and until when
    spares: list[SpareRow] = field(default_factory=list)  # the hostfile's nodes outside it
    no_majority: str | None = None  # "2 of 5": too few of the job's nodes answer to settle it
    evicted: list[str] = field(default_factory=list)  # "NODE: why": kept out of the job
    unhealthy: list[str] = field(default_factory=list)  # "NODE: why": members no spare replaced
    stragglers: list[Straggler] = field(default_factory=list)  # the leader's

    def record_json(self) -> dict[str, object]:
        """The record's and the membership's keys of every node's ``status --json`` object."""
        return {
            "attempt": self.attempt,
            "restarts_left": self.restarts_left,
            "last_restart_reason": self.last_restart_reason,
            "diagnosis": self.diagnosis,
            "leader": self.leader,
            "held": self.held,
            "generation": self.generation,
            "lost": list(self.lost),
            "replaced": list(self.replaced),
            "waiting": self.waiting,
            "spares": [asdict(spare) for spare in self.spares],
            "no_majority": self.no_majority,
            "evicted": list(self.evicted),
            "unhealthy": list(self.unhealthy),
        }

    def supervisor_json(self) -> dict[str, object]:
        """The supervisor's keys of every node's ``status --json`` object, in the fixed names: a
        claimed relaunch is still a running supervisor (``relaunching``), and there is no
        "stopped" (a stopped job has no supervisor)."""
        relaunching = self.supervisor == SupervisorState.RELAUNCHING
        supervisor: SupervisorState | SupervisorShown | None = self.supervisor
        if relaunching:
            supervisor = SupervisorState.RUNNING
        if self.supervisor == SupervisorState.STOPPED:
            supervisor = None
        return {"supervisor": supervisor, "relaunching": relaunching}


def supervision_status(
    seen: View, spares: Sequence[SpareRow] = (), changes: bool = True
) -> SupervisionStatus:
    """Pure: what status shows of a supervised job's supervision (``seen``: ``supervision.view``)
    and its spares: a record no live supervisor backs says "not responding", and an ended job
    has no leader (its supervisors are on their way out)."""
    record = seen.record
    belief = seen.belief
    no_majority = None
    if changes and not belief.quorum:  # a job that cannot change needs no majority
        no_majority = f"{belief.answered} of {belief.nodes}"
    if record is None:
        return SupervisionStatus(spares=list(spares), no_majority=no_majority)
    state: SupervisorState | SupervisorShown = record.supervisor
    reason = record.last_restart_reason
    leader = seen.leader
    if state not in RUNNING:
        leader = None
    elif leader is None and no_majority is None:
        # (with no majority in reach, the supervisors that lead may be out of reach too)
        state = SupervisorShown.NOT_RESPONDING
        reason = NOT_BACKED
    return SupervisionStatus(
        supervisor=state,
        attempt=record.attempt,
        restarts_left=record.restarts_left,
        last_restart_reason=reason,
        diagnosis=record.diagnosis,
        leader=leader,
        held=record.held,
        generation=record.generation,
        lost=list(record.lost),
        replaced=list(record.replaced),
        waiting=record.waiting,
        spares=list(spares),
        no_majority=no_majority,
        evicted=list(record.evicted),
        unhealthy=list(record.unhealthy),
        stragglers=list(record.stragglers),
    )


def supervisor_words(shown: SupervisionStatus) -> str | None:
    """Pure: the supervision in a few words, as top's header and status's first line say it:
    "running, attempt 2 of 4 (leader: node 0)", "gave up, attempt 3 of 3", "not responding"
    (None: no record). The last attempt is this one plus the restarts left: attempts a
    replacement made use up no restart."""
    if shown.supervisor is None:
        return None
    if shown.supervisor == SupervisorShown.NOT_RESPONDING:
        return str(shown.supervisor)
    final = (shown.attempt or 0) + (shown.restarts_left or 0)
    words = f"{shown.supervisor}, attempt {shown.attempt} of {final}"
    if shown.leader is not None:
        words += f" (leader: node {shown.leader})"
    return words


def spare_rows(
    pool: NodePool, job: Job, hosts: Sequence[Host], spares: Sequence[Host]
) -> list[SpareRow]:
    """Each spare's health, by the part of the supervisor's gate (the doctor's quick checks) that
    one node's facts decide without writing anything of the job's: it answers, its versions
    are the master's, it has a GPU for each of the master's slots, its clock is close, it is
    not unhealthy (``meshkit.health``), and the workdir is there and writable (a synced
    job's is made by the sync). The gate's network checks run when a spare is chosen.
    (``status`` connects to a supervised job's spares.)"""
    if not spares:
        return []

    def request(host: Host) -> p.FactsRequest:
        health = None if host == hosts[0] else health_request(job, host)  # the spares'
        return p.FactsRequest(job.workdir, "", "", False, health)

    sent = time.time()
    replies = pool.call_all("facts", request, p.FactsReply, [hosts[0], *spares])
    back = time.time()
    asked = p.StatusRequest(job.id, "")
    states = pool.call_all("status", lambda host: asked, p.StatusReply, spares)
    master = replies.get(hosts[0])
    reference = None
    if master is not None:
        reference = master.value
    slots = hosts[0].slots
    rows = []
    for spare in spares:
        outcome = replies.get(spare)
        if spare in pool.failures:
            rows.append(SpareRow(spare.label, False, f"not answering: {pool.failures[spare]}"))
        elif outcome is None or outcome.value is None:
            rows.append(SpareRow(spare.label, False, unanswered(outcome, spare, pool.failures)))
        else:
            timing = (sent, back)
            rows.append(spare_health(spare, outcome.value, reference, slots, timing, job.sync))
        state = states.get(spare)
        if (
            state is not None
            and state.value is not None
            and state.value.state == p.JobState.RUNNING
        ):
            # never a healthy spare: the other side of a partition, or a node not fenced yet
            why = "runs the job outside the membership (partitioned? fenced once it reconnects)"
            rows[-1] = SpareRow(spare.label, False, why, running=True)
    return rows


def spare_health(
    spare: Host,
    reply: p.FactsReply,
    master: p.FactsReply | None,
    slots: int | None,
    timing: tuple[float, float],
    synced: bool,
) -> SpareRow:
    """Pure: ``spare_rows``' verdict on one spare's facts."""
    checks = [versions_check(spare, reply, master), gpus_check(spare, reply, slots)]
    checks.append(clock_check(spare, reply, timing))
    if reply.health is not None:
        checks.append(health_check(spare, reply.health))
    problems = [f"{check.check}: {check.detail}" for check in checks if not check.ok]
    missing = reply.writable is not None and reply.writable.endswith(": missing")
    if reply.writable is not None and not (synced and missing):
        problems.append(f"workdir: {reply.writable}")
    if problems:
        return SpareRow(spare.label, False, "; ".join(problems))
    return SpareRow(spare.label, True)
