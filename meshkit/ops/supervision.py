"""A supervised job's supervisors over the cluster, through the ``supervisor`` op: ask every
node about its supervisor and its copy of the supervision record, take from the answers the
record believed and the leader (``view``: what status, top and stop show and build on), write
the record by compare-and-set, start a supervisor on every node, end them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..hostfile import Host
from ..job import Job
from ..protocol import Supervision, SupervisorReply, SupervisorRequest, SupervisorState
from ..quorum import Belief, Membership, believe, majority
from ..record import INT_RANGES, replace
from .pool import NodePool

STALE = 60.0  # a supervisor whose heartbeat is older is gone (a thread of its own beats every
# few seconds, whatever its loop does: only a frozen, dead or hung supervisor goes quiet)

WRITE_TIMEOUT = 15.0  # seconds a node gets to keep a write: a node that went silent since the
# last look (a partition, a node powered off) must not hold the writer for the command timeout

Answers = dict[Host, SupervisorReply]


def ask(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    action: Literal["look", "start", "end"] = "look",
    record: Supervision | None = None,
    version: int = 0,
    timeout: float | None = None,
) -> Answers:
    """The ``supervisor`` op on ``hosts``: the replies of the nodes that answered (within
    ``timeout`` s; None: the command timeout)."""
    request = SupervisorRequest(
        job.id,
        job.supervisor_tmux,
        action,
        record=record,
        version=version,
        session=job.session,
        workdir=job.workdir,
    )
    outcomes = pool.call_all(
        "supervisor", lambda host: request, SupervisorReply, hosts, timeout=timeout
    )
    return {host: outcome.value for host, outcome in outcomes.items() if outcome.value is not None}


def alive(reply: SupervisorReply) -> bool:
    """A supervisor that runs and beat within ``STALE`` s (its own node's monotonic clock: no
    skew, no step)."""
    if reply.pid is None or reply.beat is None:
        return False
    return reply.beat <= STALE


def live_ranks(hosts: Sequence[Host], answers: Answers) -> set[int]:
    """The ranks whose nodes answered with a live supervisor."""
    return {rank for rank, host in enumerate(hosts) if host in answers and alive(answers[host])}


def leader(live: Iterable[int]) -> int | None:
    """The rank whose supervisor leads: the lowest live one (None: no live supervisor)."""
    return min(live, default=None)


@dataclass(frozen=True)
class View:
    """A supervised job's supervision as the nodes' answers give it: the record believed and
    whether it may be acted on (``quorum.Belief``), and the ranks whose supervisors are live
    (``live_ranks``)."""

    belief: Belief
    live: frozenset[int]

    @property
    def record(self) -> Supervision | None:
        """The copy believed (``quorum.believe``; None: no node that answered keeps one)."""
        return self.belief.record

    @property
    def leader(self) -> int | None:
        """The rank whose supervisor leads (``leader``)."""
        return leader(self.live)


def known(job: Job) -> Membership:
    """The membership a reader of the saved ``job`` follows: its generation and members."""
    return (job.generation, tuple(job.members))


def view(answers: Answers, hosts: Sequence[Host], job: Job, nodes: int) -> View:
    """Pure: the record believed and the live supervisors, from the nodes' ``answers``
    (``hosts``: the job's nodes in rank order; ``job``: the reader's, its launch and the
    membership it follows; ``nodes``: the count of the job's hostfile nodes, spares included,
    a majority of which must carry a new membership)."""
    copies = [reply.record for reply in answers.values()]
    belief = believe(copies, nodes, job.launch, known(job))
    return View(belief, frozenset(live_ranks(hosts, answers)))


def look(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    cluster: Sequence[Host],
    asked: Sequence[Host] | None = None,
) -> View:
    """``view`` of the answers of the nodes ``asked`` (None: every node of ``cluster``, the
    job's hostfile nodes, spares included, that the pool reaches), against the saved job: what
    ``status``, ``top`` and ``stop`` show and build on."""
    every = [*hosts, *(host for host in cluster if host not in hosts)]
    answers = ask(pool, job, every if asked is None else asked)
    return view(answers, hosts, job, len(every))


def stop_record(record: Supervision | None, job: Job) -> Supervision:
    """Pure: the record ``meshkit stop`` leaves on every node of the job, spares included: the
    believed one (``View.record``), STOPPED, one version on and of the job's launch (a job none of
    whose nodes keeps a copy gets a bare one)."""
    if record is None:
        record = Supervision(SupervisorState.STOPPED, 0, job.restarts)
    return replace(
        record,
        supervisor=SupervisorState.STOPPED,
        version=next_version(record),
        held=None,
        launch=job.launch,
    )


def next_version(record: Supervision) -> int:
    """Pure: the version a write of ``record`` carries: one on, but never past the range a
    node accepts (a copy at its top, damaged or a bad node's, must not make a stop unwritable:
    compare-and-set still keeps a write of the same version)."""
    return min(record.version + 1, INT_RANGES["Count"][1])


def write(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    record: Supervision,
    by: int,
    every: bool = False,
    cluster: Sequence[Host] = (),
    silent: Sequence[Host] = (),
) -> Supervision | None:
    """Compare-and-set ``record`` (one version on, written by rank ``by``, of the job's launch) on
    the job's nodes: the lowest-ranked connected member first (it decides between two writers),
    then the other members and the rest of ``cluster`` (the hostfile's other nodes: spares, lost
    nodes) at once. None unless the first member (``every``: every member) and a majority of
    the job's nodes (``cluster``; none: no majority is asked, ``membership.can_change``) kept
    it: a node holds a newer copy (another supervisor moved on, or a stop), or this side of a
    partition is no majority (``quorum``). ``silent``: nodes not written to (they left a poll
    unanswered: a write would wait its whole timeout), counted all the same."""
    new = replace(record, version=next_version(record), by=by, launch=job.launch)
    others = [host for host in cluster if host not in hosts]
    count = len(hosts) + len(others)
    skipped = set(silent) | set(pool.failures)
    up = [host for host in hosts if host not in skipped]
    first = ask(pool, job, up[:1], record=new, version=record.version, timeout=WRITE_TIMEOUT)
    if not first or not all(reply.written for reply in first.values()):
        return None
    rest = up[1:] + [host for host in others if host not in skipped]
    answers = first | ask(
        pool, job, rest, record=new, version=record.version, timeout=WRITE_TIMEOUT
    )
    members = [reply for host, reply in answers.items() if host in hosts]
    if every and (len(members) < len(hosts) or not all(reply.written for reply in members)):
        return None
    kept = sum(1 for reply in answers.values() if reply.written)
    if cluster and kept < majority(count):
        return None
    return new


def start_all(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[str]:
    """A supervisor in tmux on every node where none is live (``meshkit supervise``, its output
    in ``job.supervisor_log(rank)``). Returns the nodes it failed on."""

    def start(host: Host) -> SupervisorRequest:
        rank = hosts.index(host)
        argv = [job.python, "-m", "meshkit", "supervise"]
        argv += ["--hostfile", job.node_hostfile, "--session", job.session]
        argv += ["--workdir", job.workdir]
        argv += ["--rank", str(rank), "--log", job.supervisor_log(rank)]
        return SupervisorRequest(
            job.id, job.supervisor_tmux, "start", argv, session=job.session, workdir=job.workdir
        )

    outcomes = pool.call_all("supervisor", start, SupervisorReply, hosts)
    failed = [
        f"{host.label}: {outcome.error}"
        for host, outcome in outcomes.items()
        if outcome.value is None
    ]
    unreached = [f"{host.label}: {why}" for host, why in pool.failures.items() if host in hosts]
    return failed + unreached


def end_supervisor(
    pool: NodePool, job: Job, hosts: Sequence[Host], stopped: Supervision | None = None
) -> list[str]:
    """End the job's supervisors on every node, before the job itself is touched (one would
    take a stop for a failure and relaunch), and drop their record copies, or with ``stopped``
    (``meshkit stop``) leave that record as every copy. Looked at again until a round finds
    none: a leader ended mid-relaunch may have started one meanwhile. Returns the nodes where
    one survived."""
    for _ in range(3):
        answers = ask(pool, job, hosts, action="end", record=stopped)
        left = [
            f"{host.label}: supervisor pid {reply.left} survived"
            for host, reply in answers.items()
            if reply.left
        ]
        if left or all(reply.pid is None for reply in answers.values()):
            return left
    return []
