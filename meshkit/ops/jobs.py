"""Jobs over a cluster: the env round, preflight, launch, status, stop and logs, a supervised
job's supervision included in its status (once for the job, beside the nodes' rows) and stop.
Every node operation goes through the node agent (``NodePool``); these functions print nothing
and return dataclasses for the CLI (or a script, through ``meshkit.Cluster``) to render. The
verdicts (preflight problems, port choice, status rows) are pure functions of the replies,
unit-tested with a fake pool.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

from .. import protocol as p
from ..errors import LaunchError, NodeFailed, ProtocolError
from ..events import EventKind
from ..health import NodeHealth
from ..hostfile import Host, members_text
from ..job import JOB_FILE_MODE, STRAGGLER_RATIO, Job
from ..jobindex import index_root
from ..outcome import Outcome
from ..protocol import JobState, Straggler, Supervision
from ..record import replace
from ..stragglers import Slowdown, slowdown
from .events import new_event, tell
from .health import health_request
from .lookup import cluster_hosts
from .membership import can_change, spares_of
from .pool import NodePool, unanswered
from .progress_status import Named, named, rank_json, straggler_json
from .stall import Watched, stall
from .supervision import end_supervisor, look, stop_record
from .supervision_status import RUNNING, SupervisionStatus, spare_rows, supervision_status
from .verdicts import env_error

PORT_SCAN = 20  # ports tried after the derived one when it is busy on the master
FOLLOW = 0.5  # seconds between polls of logs --follow
Envs = dict[Host, Outcome[p.EnvReply]]


@dataclass(frozen=True)
class Preflight:
    problems: list[str]
    port: int
    note: str | None


def env_round(pool: NodePool, job: Job, hosts: Sequence[Host], phase: str = "env") -> Envs:
    """Rank discovery on every node of ``hosts``, as the job's ``meshkit run`` will do it
    there."""
    request = job.env_request()
    return pool.call_all(phase, lambda host: request, p.EnvReply, hosts)


def env_verdicts(
    job: Job, hosts: Sequence[Host], envs: Envs, failures: dict[Host, str]
) -> list[str]:
    """Pure: every node must discover exactly its hostfile rank, and all must agree on the node
    count, master and port. Only the failures of ``hosts`` count: a supervisor's pool reaches
    the rest of the hostfile too (spares, lost nodes), and a lost node that does not answer
    must not hold up the launch of the membership that replaced it."""
    problems = [
        f"{host.label}: cannot connect: {why}" for host, why in failures.items() if host in hosts
    ]
    seen: dict[tuple[str, str, str], list[str]] = {}
    for rank, host in enumerate(hosts):
        if host not in envs:
            continue  # not reached (named above)
        error = env_error(envs[host], None)
        reply = envs[host].value
        if error is not None or reply is None:
            problems.append(f"{host.label}: {error}")
            continue
        found = reply.variables.get("NODE_RANK")
        agreed = ("NNODES", "MASTER_ADDR", "MASTER_PORT")
        key = tuple(reply.variables.get(name, "?") for name in agreed)
        if found != str(rank):
            where = f"line {host.lineno} of {job.hostfile} (rank {rank})"
            problems.append(
                f"{host.label}: is {where} but discovers NODE_RANK={found} via {reply.matched}; "
                "the hostfile does not name this node as it sees itself"
            )
        seen.setdefault((key[0], key[1], key[2]), []).append(host.label)
    if len(seen) > 1:
        problems.append(
            "nodes disagree on NNODES/MASTER_ADDR/MASTER_PORT: "
            + "; ".join(f"{'/'.join(key)} on {', '.join(labels)}" for key, labels in seen.items())
        )
    return problems


def conflict_verdicts(
    job: Job, running: dict[Host, list[p.RunningJob]], replace: bool
) -> list[str]:
    """Pure: another job running on a node stops the launch unless ``--replace``."""
    if replace:
        return []
    return [
        f"{host.label}: another meshkit job is running there: {other.label}; stop it "
        f"(meshkit stop --workdir ... --session ...) or pass --replace to end it"
        for host, jobs in running.items()
        for other in jobs
        if other.job_id != job.id
    ]


def pick_port(probe: p.PortsReply, job: Job, master: Host) -> tuple[int, str | None]:
    """The derived port if free, or held by this very job (replacing it frees the port), else the
    next free one, which every node is then given."""
    ports = probe.ports
    if not ports or ports[0].free or probe.ours:
        return job.master_port, None
    free = [state.port for state in ports if state.free]
    if not free:
        raise LaunchError(
            f"ports {ports[0].port}..{ports[-1].port} are all busy on the master {master.label}; "
            "pass --master-port"
        )
    note = f"master port {job.master_port} is busy on {master.label}; using {free[0]} on every node"
    return free[0], note


def preflight(
    pool: NodePool, job: Job, hosts: Sequence[Host], envs: Envs, replace: bool = False
) -> Preflight:
    """Read-only, on every node, given the env round (``envs``): each node discovers exactly its
    hostfile rank and the same master; which meshkit jobs run there; and on the master, which
    ports are free."""
    ok = [host for host in hosts if env_error(envs.get(host), pool.failures.get(host)) is None]
    jobs = pool.call_all("jobs", lambda host: p.JobsRequest(), p.JobsReply, ok)
    running = {
        host: outcome.value.running for host, outcome in jobs.items() if outcome.value is not None
    }
    problems = env_verdicts(job, hosts, envs, pool.failures)
    problems += [
        f"{host.label}: {outcome.error}" for host, outcome in jobs.items() if outcome.error
    ]
    problems += conflict_verdicts(job, running, replace)
    if problems:
        return Preflight(problems, job.master_port, None)
    master = hosts[0]
    last = min(job.master_port + PORT_SCAN, 65535)
    ports = p.PortsRequest(job.id, list(range(job.master_port, last + 1)))
    outcome = pool.call_all("ports", lambda host: ports, p.PortsReply, [master]).get(master)
    if outcome is None or outcome.value is None:
        why = outcome.error if outcome else "?"
        problems.append(f"{master.label}: port probe failed: {why}")
        return Preflight(problems, job.master_port, None)
    port, note = pick_port(outcome.value, job, master)
    return Preflight(problems, port, note)


@dataclass(frozen=True)
class StartRow:
    node_rank: int
    host: str
    state: JobState
    error: str | None
    replaced: list[str]

    @property
    def ok(self) -> bool:
        return self.error is None and self.state in (JobState.RUNNING, JobState.EXITED)


@dataclass(frozen=True)
class Launch:
    job: Job
    rows: list[StartRow]
    note: str | None
    dry_run: bool
    synced: dict[str, int] | None = None  # host -> files copied (a synced job's nodes)

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)


def launch(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    *,
    replace: bool = False,
    dry_run: bool = False,
    attempt: int = 1,
    envs: Envs | None = None,
    synced: dict[str, int] | None = None,
    reason: str = "start",
    replacement: str = "",
    last: int = 0,
) -> Launch:
    """Preflight everywhere (read-only; any problem starts nothing anywhere), save the job and
    its index through the master (every node when the workdir is synced), then start it on every
    node. A synced job's workdir is copied first (only what changed), unless the caller just did
    (``synced``: what it copied). ``envs``: the env round when the caller has it already (it
    runs once per command, after any copy). ``reason``, ``replacement``: what every rank learns
    of this attempt (``Job.node_job``)."""
    if job.sync and not dry_run and synced is None:
        from .sync import sync_workdir

        synced = sync_workdir(pool, job, hosts)
    if job.members and not dry_run:
        # before the env round: every node's discovery reads the membership's hostfile
        for where in job.home_copies(hosts):
            pool.write_file(where, job.node_hostfile, members_text(hosts))
    if envs is None:
        envs = env_round(pool, job, hosts)
    checked = preflight(pool, job, hosts, envs, replace)
    if checked.problems:
        raise LaunchError([*checked.problems, "train: preflight failed; nothing was started"])
    job = replace_port(job, checked.port)
    if dry_run:
        return Launch(job, [], checked.note, True, synced)
    for where in job.home_copies(hosts):
        # job.json holds the config's `env`, where tokens go: the user's alone
        pool.write_file(where, str(job.file), job.to_json(), JOB_FILE_MODE)
        root = index_root(job.hostfile)
        pool.write_file(where, job.index, job.index_json(), root=root)
    spec = job.node_job(attempt, reason, replacement, last)
    # the job's nodes only: a supervisor's pool reaches the hostfile's spares too
    request = p.StartRequest(spec, replace, job.launch, job.generation)
    started = pool.call_all("start", lambda host: request, p.StartReply, hosts)
    rows = []
    for rank, host in enumerate(hosts):
        outcome = started.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, pool.failures)
            rows.append(StartRow(rank, host.label, JobState.ABSENT, why, []))
            continue
        reply = outcome.value
        error = reply.error if not reply.started else None
        if reply.conflicts:
            others = ", ".join(running.label for running in reply.conflicts)
            error = f"another meshkit job is running: {others}"
        replaced = [running.label for running in reply.replaced]
        rows.append(StartRow(rank, host.label, reply.state, error, replaced))
    return Launch(job, rows, checked.note, False, synced)


def replace_port(job: Job, port: int) -> Job:
    return job if port == job.master_port else replace(job, master_port=port)


@dataclass(frozen=True)
class StatusRow:
    """One node's part of the job, as its agent answered (or why it did not)."""

    node_rank: int
    host: str
    state: JobState
    exit_code: int | None
    started: str | None  # ISO 8601, UTC
    last_line: str | None
    error: str | None = None
    silent: bool = False  # with an error: the node gave no reply at all (not its own failure)
    idle_s: float | None = None  # seconds since the node's log was last written
    stalled: bool = False  # the job's: running, and no node has written output for stall_after
    last_known: str | None = None  # of a node that gave no answer: what the record last knew
    health: NodeHealth | None = None  # when asked, of a node that answered
    ended: float | None = None  # when its part exited (a wall time, the node's clock)
    progress: list[p.RankProgress] = field(default_factory=list)  # its ranks' steps, if told

    def as_json(
        self, supervision: SupervisionStatus | None = None, straggler: Straggler | None = None
    ) -> dict[str, object]:
        """The ``--json`` shape of this node: with ``supervision`` (a supervised job's, the
        same for every node) its keys too. A node that answered with its own error is
        ``error``, as the text table says; one that gave no answer is ``unreachable`` (whether
        the job runs there is unknown: never ``absent``), its ``last_line`` what was last
        known of it. ``progress``: its ranks' steps (empty: none tells them); ``straggler``:
        null, or its figures when status names it one."""
        keys = ["node_rank", "host", "state", "exit_code", "started", "last_line", "stalled"]
        data = {key: getattr(self, key) for key in keys}
        if self.error and not self.silent:
            data["state"] = "error"
        if self.error and self.silent:
            data["state"] = UNREACHABLE
            data["last_known"] = self.last_known
        if supervision is not None:
            data.update(supervision.record_json())
        data["idle_s"] = None if self.idle_s is None else round(self.idle_s, 1)
        data["health"] = None if self.health is None else self.health.as_json()
        data["progress"] = [rank_json(rank) for rank in self.progress]
        data["straggler"] = straggler_json(straggler)
        if supervision is not None:
            data.update(supervision.supervisor_json())
        return data


@dataclass(frozen=True)
class JobStatus:
    """``meshkit status``: each node's row, and once for the job a supervised job's
    supervision (None: the job is not supervised)."""

    rows: list[StatusRow]
    supervision: SupervisionStatus | None = None
    straggler_ratio: float = STRAGGLER_RATIO  # the job's --straggler-ratio

    def stragglers(self) -> Named:
        """The stragglers named: a supervised job's leader's, from its record, while a
        supervisor runs; else this poll's, from the rows' progress."""
        record = None
        shown = self.supervision
        if shown is not None and shown.supervisor in RUNNING:
            record = shown.stragglers
        nodes = {row.host: row.progress for row in self.rows if row.progress}
        return named(nodes, self.straggler_ratio, record)

    def slowdown(self) -> Slowdown | None:
        """The job's step time against its first minutes, of a job whose ranks tell steps
        but time no compute sections (None: not known, or attributed by ``stragglers``)."""
        progress = [rank for row in self.rows for rank in row.progress]
        return slowdown(progress)

    def as_json(self) -> list[dict[str, object]]:
        """The ``--json`` shape: one object per node, each with the job's supervision keys
        when it is supervised."""
        figures = self.stragglers().nodes
        return [row.as_json(self.supervision, figures.get(row.host)) for row in self.rows]


def watched(rows: Sequence[StatusRow]) -> list[Watched]:
    """The rows of nodes that answered, as a stall is judged on them (``ops.stall``)."""
    return [Watched(row.host, row.state, row.idle_s, row.progress) for row in rows if not row.error]


def status(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    phase: str = "status",
    timeout: float | None = None,
    health: bool = False,
) -> list[StatusRow]:
    """One row per node; a node that cannot be asked (within ``timeout`` s; None: the command
    timeout) is ``absent`` with the reason. Every row says whether the job is stalled; with
    ``health``, each answering node's health (``StatusRow.health``)."""

    def request(host: Host) -> p.StatusRequest:
        asked = health_request(job, host) if health else None
        return p.StatusRequest(job.id, job.log(hosts.index(host)), asked, job.straggler_window)

    replies = pool.call_all(
        phase,
        request,
        p.StatusReply,
        hosts,
        timeout=timeout,
    )
    rows = []
    for rank, host in enumerate(hosts):
        outcome = replies.get(host)
        if outcome is None or outcome.value is None:
            error = unanswered(outcome, host, pool.failures)
            # the node's agent answered, with its failure or a malformed reply; else nothing
            replied = outcome is not None and isinstance(outcome.exc, (NodeFailed, ProtocolError))
            row = StatusRow(
                rank,
                host.label,
                JobState.ABSENT,
                None,
                None,
                f"error: {error}",
                error,
                silent=not replied,
            )
            rows.append(row)
            continue
        reply = outcome.value
        started = None
        if reply.started:
            utc = datetime.datetime.fromtimestamp(reply.started, datetime.timezone.utc)
            started = utc.isoformat()
        row = StatusRow(
            rank,
            host.label,
            reply.state,
            reply.exit_code,
            started,
            reply.last_line,
            idle_s=reply.idle,
            health=reply.health,
            ended=reply.ended,
            progress=reply.progress,
        )
        rows.append(row)
    if stall(job, watched(rows)) is None:
        return rows
    return [replace(row, stalled=True) for row in rows]


def wait_done(pool: NodePool, job: Job, hosts: Sequence[Host], timeout: float) -> list[StatusRow]:
    """Poll status until no node is running (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = status(pool, job, hosts, phase="")
        if all(row.state != JobState.RUNNING for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(1.0)


def job_status(pool: NodePool, job: Job, hosts: Sequence[Host]) -> JobStatus:
    """``meshkit status``: each node's row, and a supervised job's supervision: the believed
    record and its leader (``supervision.look``), and each spare's health; each node's
    health (``meshkit.health``) in its row."""
    rows = status(pool, job, hosts, health=True)
    if not job.supervised:
        return JobStatus(rows, straggler_ratio=job.straggler_ratio)
    cluster = cluster_hosts(job)
    seen = look(pool, job, hosts, cluster)
    evicted = [] if seen.record is None else seen.record.evicted
    spares = spare_rows(pool, job, hosts, spares_of(cluster, hosts, evicted))
    rows = [last_known(row, seen.record) for row in rows]
    changes = can_change(job, hosts, cluster)
    shown = supervision_status(seen, spares, changes)
    return JobStatus(rows, shown, job.straggler_ratio)


def last_known(row: StatusRow, record: Supervision | None) -> StatusRow:
    """Pure: a row of a node that gave no answer, with what the supervision record last knew
    of it (its rank and generation, and the exit code it last ended with)."""
    if not (row.error and row.silent) or record is None:
        return row
    known = f"rank {row.node_rank} of generation {record.generation}"
    codes = record.exit_codes
    if row.node_rank < len(codes) and codes[row.node_rank] is not None:
        known += f", last exit code {codes[row.node_rank]}"
    if row.host in record.lost:
        known += ", lost"
    return replace(row, last_known=known)


@dataclass(frozen=True)
class StopRow:
    node_rank: int
    host: str
    found: bool
    signalled: int
    left: list[int]
    error: str | None

    @property
    def ok(self) -> bool:
        """Verified: the node answered and nothing of the job is alive there."""
        return self.error is None and not self.left


def stop(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[StopRow]:
    """End the job's whole process tree on every node, then check (on the node) that nothing of
    it is left. A node that cannot be asked is a failure, never "nothing left"."""
    replies = pool.call_all("stop", lambda host: p.StopRequest(job.id), p.StopReply, hosts)
    rows = []
    for rank, host in enumerate(hosts):
        outcome = replies.get(host)
        if outcome is None or outcome.value is None:
            error = unanswered(outcome, host, pool.failures)
            rows.append(StopRow(rank, host.label, False, 0, [], error))
        else:
            reply = outcome.value
            rows.append(StopRow(rank, host.label, reply.found, reply.signalled, reply.left, None))
    return rows


UNREACHABLE = "unreachable"  # status's state of a node that gave no answer

UNREACHED = "the job may still run there; `meshkit stop` again once it answers ends it"
UNREACHED_SUPERVISED = (
    "the job and its supervisor may still run there; the supervisor relaunches nothing: when it "
    "reconnects it finds the stop, ends the job there and ends itself (`meshkit stop` again once "
    "the node answers checks it)"
)


@dataclass(frozen=True)
class Unreached:
    """A node ``stop`` could not ask, and what happens there (``then``)."""

    node_rank: int
    host: str
    error: str
    then: str


@dataclass(frozen=True)
class Stopped:
    """``meshkit stop``: each node's row, the supervisors that could not be ended (then the job
    was still stopped), and the nodes it could not reach."""

    rows: list[StopRow]
    supervisor_left: list[str]
    unreached: list[Unreached] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.supervisor_left and all(row.ok for row in self.rows)

    def as_json(self) -> dict[str, object]:
        """The ``stop --json`` shape."""
        return {
            "ok": self.ok,
            "nodes": [asdict(row) for row in self.rows],
            "supervisor_left": self.supervisor_left,
            "unreached": [asdict(node) for node in self.unreached],
        }


def stop_with_supervisors(pool: NodePool, job: Job, hosts: Sequence[Host]) -> Stopped:
    """``meshkit stop``: end every supervisor first (each would take the stop for a failure),
    leaving a stopped record on every node that answers (a supervisor this stop cannot reach
    finds it when it reconnects, and relaunches nothing), then the job."""
    left = []
    then = UNREACHED
    every = list(hosts)
    if job.supervised:
        cluster = cluster_hosts(job)
        stopped = stop_record(look(pool, job, hosts, cluster).record, job)
        # spares too: a supervisor cut off from the members may claim them for a new
        # generation, and must find the stop there
        every = [*hosts, *(host for host in cluster if host not in hosts)]
        left = end_supervisor(pool, job, every, stopped)
        then = UNREACHED_SUPERVISED
    rows = stop(pool, job, hosts)
    unreached = [Unreached(row.node_rank, row.host, row.error, then) for row in rows if row.error]
    said = (
        "meshkit stop ended the job" if not unreached else "meshkit stop (not every node answered)"
    )
    tell(pool, job, every, [new_event(job, EventKind.STOPPED, said, by="stop")])
    return Stopped(rows, left, unreached)


@dataclass(frozen=True)
class LogChunk:
    rank: int
    lines: list[str]
    error: str | None = None


def logs(
    pool: NodePool, job: Job, hosts: Sequence[Host], ranks: Sequence[int], lines: int
) -> list[LogChunk]:
    return next(follow(pool, job, hosts, ranks, lines))


def follow(
    pool: NodePool, job: Job, hosts: Sequence[Host], ranks: Sequence[int], lines: int
) -> Iterator[list[LogChunk]]:
    """The last ``lines`` lines, then whatever each node appends, polled every ``FOLLOW`` s
    through the same agents (ends when the caller stops iterating, e.g. on Ctrl-C)."""
    offsets: dict[Host, int] = {}
    phase = "logs"
    while True:
        replies = pool.call_all(
            phase,
            lambda host: p.LogsRequest(job.log(hosts.index(host)), lines, offsets.get(host)),
            p.LogsReply,
            [hosts[rank] for rank in ranks],
        )
        chunks = []
        for rank in ranks:
            host = hosts[rank]
            outcome = replies.get(host)
            if outcome is None or outcome.value is None:
                if host not in offsets:
                    chunks.append(LogChunk(rank, [], unanswered(outcome, host, pool.failures)))
                continue
            offsets[host] = outcome.value.offset
            chunks.append(LogChunk(rank, outcome.value.lines))
        yield chunks
        phase = ""  # the progress line once, not every poll
        time.sleep(FOLLOW)
