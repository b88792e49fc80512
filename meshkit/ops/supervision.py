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
from ..record import replace
from .pool import NodePool

STALE = 60.0  # a supervisor whose heartbeat is older is gone (a thread of its own beats every
# few seconds, whatever its loop does: only a frozen, dead or hung supervisor goes quiet)

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


def far_ahead(record: Supervision, generation: int, nodes: int) -> bool:
    """Pure: whether a node's copy claims a generation more than ``nodes`` (the hostfile's node
    count) past ``generation`` (the newest this supervisor knows): so many changes of membership
    while it looked on are not believable, and the newest generation wins, so one node sending
    an absurd one (a damaged copy, a bad node) would pin the record and move the job to
    whatever membership it names. Such a copy is ignored, not followed."""
    return record.generation > generation + nodes


def newest(copies: Iterable[Supervision | None]) -> Supervision | None:
    """Pure: the copy that wins (None: no node has one): a stop, else the newest."""
    records = [copy for copy in copies if copy is not None]
    return max(records, key=Supervision.precedence, default=None)


def believed(
    copies: Iterable[Supervision | None], generation: int, nodes: int
) -> Supervision | None:
    """Pure: the copy that wins of those not ``far_ahead`` of ``generation`` (None: no node has
    one), its version lifted past every copy left out, so that the next write replaces those
    too. What a supervisor follows and what status, top and stop show and build on."""
    records = [copy for copy in copies if copy is not None]
    kept = [copy for copy in records if not far_ahead(copy, generation, nodes)]
    left_out = [copy.version for copy in records if far_ahead(copy, generation, nodes)]
    record = newest(kept)
    if record is None or not left_out:
        return record
    return replace(record, version=max(record.version, *left_out))


def leader(live: Iterable[int]) -> int | None:
    """The rank whose supervisor leads: the lowest live one (None: no live supervisor)."""
    return min(live, default=None)


@dataclass(frozen=True)
class View:
    """A supervised job's supervision as the nodes' answers give it: the record believed
    (``believed``; None: no node that answered keeps a copy) and the ranks whose supervisors are
    live (``live_ranks``)."""

    record: Supervision | None
    live: frozenset[int]

    @property
    def leader(self) -> int | None:
        """The rank whose supervisor leads (``leader``)."""
        return leader(self.live)


def view(answers: Answers, hosts: Sequence[Host], generation: int, nodes: int) -> View:
    """Pure: the record believed and the live supervisors, from the nodes' ``answers``
    (``hosts``: the job's nodes in rank order; ``generation``: the newest the reader knows;
    ``nodes``: the hostfile's node count, spares included, ``far_ahead``'s bound)."""
    copies = [reply.record for reply in answers.values()]
    record = believed(copies, generation, nodes)
    return View(record, frozenset(live_ranks(hosts, answers)))


def look(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    nodes: int,
    asked: Sequence[Host] | None = None,
) -> View:
    """``view`` of the answers of the nodes ``asked`` (None: all of ``hosts``), against the
    saved job's generation: what ``status``, ``top`` and ``stop`` show and build on."""
    answers = ask(pool, job, hosts if asked is None else asked)
    return view(answers, hosts, job.generation, nodes)


def stop_record(record: Supervision | None, restarts: int) -> Supervision:
    """Pure: the record ``meshkit stop`` leaves on every node: the believed one (``View.record``),
    STOPPED and one version on (a job none of whose nodes keeps a copy gets a bare one)."""
    if record is None:
        record = Supervision(SupervisorState.STOPPED, 0, restarts)
    return replace(
        record, supervisor=SupervisorState.STOPPED, version=record.version + 1, held=None
    )


def write(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    record: Supervision,
    by: int,
    every: bool = False,
) -> Supervision | None:
    """Compare-and-set ``record`` (one version on, written by rank ``by``) on the nodes: the
    lowest-ranked connected node first (it decides between two writers), then the rest at once.
    None: a node holds a newer copy (another supervisor moved on), or (``every``) some node did
    not answer."""
    new = replace(record, version=record.version + 1, by=by)
    up = [host for host in hosts if host not in pool.failures]
    first = ask(pool, job, up[:1], record=new, version=record.version)
    if not first or not all(reply.written for reply in first.values()):
        return None
    answers = first | ask(pool, job, up[1:], record=new, version=record.version)
    if not all(reply.written for reply in answers.values()):
        return None
    if every and len(answers) < len(hosts):
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
