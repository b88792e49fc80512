"""Jobs over a cluster: the env round, preflight, launch, status, stop and logs. Every node
operation goes through the node agent (``NodePool``); these functions print nothing and return
dataclasses for the CLI (or a script, through ``meshkit.Cluster``) to render. The verdicts
(preflight problems, port choice, status rows) are pure functions of the replies, unit-tested
with a fake pool.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from .. import protocol as p
from ..errors import LaunchError
from ..hostfile import Host
from ..job import Job
from ..outcome import Outcome
from ..record import replace
from .pool import NodePool, unanswered

PORT_SCAN = 20  # ports tried after the derived one when it is busy on the master
FOLLOW = 0.5  # seconds between polls of logs --follow
JobState = Literal["running", "exited", "absent"]
# A job's supervision (ops.supervise): running, relaunching (a claimed attempt), then gave up or
# done; "not responding" is what status shows when no live supervisor backs the record.
SupervisorState = Literal["running", "relaunching", "gave up", "done", "not responding"]
Envs = dict[Host, Outcome[p.EnvReply]]


@dataclass(frozen=True)
class Preflight:
    problems: list[str]
    port: int
    note: str | None


def env_round(pool: NodePool, job: Job, phase: str = "env") -> Envs:
    """Rank discovery on every node, as the job's ``meshkit run`` will do it there."""
    request = job.env_request()
    return pool.call_all(phase, lambda h: request, p.EnvReply)


def env_error(outcome: Outcome[p.EnvReply] | None, failure: str | None) -> str | None:
    """Why a node has no usable discovery: unreachable, its agent failed, or discovery there
    failed (its own message); None when it has one."""
    if outcome is None:
        return f"cannot connect: {failure or 'unknown'}"
    if outcome.value is None:
        return str(outcome.error)
    return outcome.value.error


def env_verdicts(
    job: Job, hosts: Sequence[Host], envs: Envs, failures: dict[Host, str]
) -> list[str]:
    """Pure: every node must discover exactly its hostfile rank, and all must agree on the node
    count, master and port."""
    problems = [f"{h.label}: cannot connect: {e}" for h, e in failures.items()]
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
        key = tuple(reply.variables.get(k, "?") for k in ("NNODES", "MASTER_ADDR", "MASTER_PORT"))
        if found != str(rank):
            problems.append(
                f"{host.label}: is line {host.lineno} of {job.hostfile} (rank {rank}) but discovers "
                f"NODE_RANK={found} via {reply.matched}; the hostfile does not name this node as "
                "it sees itself"
            )
        seen.setdefault((key[0], key[1], key[2]), []).append(host.label)
    if len(seen) > 1:
        problems.append(
            "nodes disagree on NNODES/MASTER_ADDR/MASTER_PORT: "
            + "; ".join(f"{'/'.join(k)} on {', '.join(v)}" for k, v in seen.items())
        )
    return problems


def conflict_verdicts(
    job: Job, running: dict[Host, list[p.RunningJob]], replace: bool
) -> list[str]:
    """Pure: another job running on a node stops the launch unless ``--replace``."""
    if replace:
        return []
    return [
        f"{h.label}: another meshkit job is running there: {r.label}; stop it "
        f"(meshkit stop --workdir ... --session ...) or pass --replace to end it"
        for h, jobs in running.items()
        for r in jobs
        if r.job_id != job.id
    ]


def pick_port(probe: p.PortsReply, job: Job, master: Host) -> tuple[int, str | None]:
    """The derived port if free, or held by this very job (replacing it frees the port), else the
    next free one, which every node is then given."""
    ports = probe.ports
    if not ports or ports[0].free or probe.ours:
        return job.master_port, None
    free = [s.port for s in ports if s.free]
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
    ok = [h for h in hosts if env_error(envs.get(h), pool.failures.get(h)) is None]
    jobs = pool.call_all("jobs", lambda h: p.JobsRequest(), p.JobsReply, ok)
    running = {h: o.value.running for h, o in jobs.items() if o.value is not None}
    problems = env_verdicts(job, hosts, envs, pool.failures)
    problems += [f"{h.label}: {o.error}" for h, o in jobs.items() if o.error]
    problems += conflict_verdicts(job, running, replace)
    port, note = job.master_port, None
    if not problems:
        scan = [n for n in range(job.master_port, job.master_port + PORT_SCAN + 1) if n <= 65535]
        ports = p.PortsRequest(job.id, scan)
        outcome = pool.call_all("ports", lambda h: ports, p.PortsReply, hosts[:1]).get(hosts[0])
        if outcome is None or outcome.value is None:
            why = outcome.error if outcome else "?"
            problems.append(f"{hosts[0].label}: port probe failed: {why}")
        else:
            port, note = pick_port(outcome.value, job, hosts[0])
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
        return self.error is None and self.state in ("running", "exited")


@dataclass(frozen=True)
class Launch:
    job: Job
    rows: list[StartRow]
    note: str | None
    dry_run: bool
    synced: dict[str, int] | None = None  # host -> files copied (a synced job's nodes)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)


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
) -> Launch:
    """Preflight everywhere (read-only; any problem starts nothing anywhere), save the job and
    its index through the master (every node when the workdir is synced), then start it on every
    node. A synced job's workdir is copied first (only what changed), unless the caller just did
    (``synced``: what it copied). ``envs``: the env round when the caller has it already (it
    runs once per command, after any copy)."""
    if job.sync and not dry_run and synced is None:
        from .sync import sync_workdir

        synced = sync_workdir(pool, job, hosts)
    checked = preflight(pool, job, hosts, env_round(pool, job) if envs is None else envs, replace)
    if checked.problems:
        raise LaunchError([*checked.problems, "train: preflight failed; nothing was started"])
    job = replace_port(job, checked.port)
    if dry_run:
        return Launch(job, [], checked.note, True, synced)
    for where in hosts if job.sync else hosts[:1]:
        pool.write_file(where, str(job.file), job.to_json())
        pool.write_file(where, str(job.index), job.index_json())
    spec = job.node_job(attempt)
    started = pool.call_all("start", lambda h: p.StartRequest(spec, replace), p.StartReply)
    rows = []
    for rank, h in enumerate(hosts):
        outcome = started.get(h)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, h, pool.failures)
            rows.append(StartRow(rank, h.label, "absent", why, []))
            continue
        reply = outcome.value
        error = reply.error if not reply.started else None
        if reply.conflicts:
            error = "another meshkit job is running: " + ", ".join(r.label for r in reply.conflicts)
        rows.append(StartRow(rank, h.label, reply.state, error, [r.label for r in reply.replaced]))
    return Launch(job, rows, checked.note, False, synced)


def replace_port(job: Job, port: int) -> Job:
    return job if port == job.master_port else replace(job, master_port=port)


@dataclass(frozen=True)
class StatusRow:
    node_rank: int
    host: str
    state: JobState
    exit_code: int | None
    started: str | None  # ISO 8601, UTC
    last_line: str | None
    error: str | None = None
    supervised: bool = False  # train --restarts: the six fields below are shown
    attempt: int | None = None
    restarts_left: int | None = None
    last_restart_reason: str | None = None
    supervisor: SupervisorState | None = None  # None: no record (e.g. after stop)
    idle_s: float | None = None  # seconds since the node's log was last written
    stalled: bool = False  # the job's: running, and no node has written output for stall_after
    diagnosis: str | None = None  # the diagnosis the supervisor saved before a stall restart
    leader: int | None = None  # the rank whose supervisor leads (None: no live one)
    held: str | None = None  # what holds a relaunch: "NODE: CHECK: DETAIL"

    def as_json(self) -> dict[str, object]:
        """The ``--json`` shape: the supervision fields only for a supervised job."""
        keys = ["node_rank", "host", "state", "exit_code", "started", "last_line", "stalled"]
        if self.supervised:
            keys += ["attempt", "restarts_left", "last_restart_reason", "diagnosis"]
            keys += ["leader", "held"]
        data = {k: getattr(self, k) for k in keys}
        data["idle_s"] = None if self.idle_s is None else round(self.idle_s, 1)
        if self.supervised:  # the fixed names: a claimed relaunch is still a running supervisor
            data["supervisor"] = "running" if self.supervisor == "relaunching" else self.supervisor
            data["relaunching"] = self.supervisor == "relaunching"
        return data


def is_stalled(stall_after: float | None, nodes: Sequence[tuple[str, float | None]]) -> bool:
    """Pure: a running job none of whose running nodes has written output for ``stall_after``
    seconds (each node's log, by its own clock). ``nodes``: (state, idle seconds)."""
    running = [idle for state, idle in nodes if state == "running"]
    if stall_after is None or not running:
        return False
    return all(i is not None and i >= stall_after for i in running)


def status(
    pool: NodePool, job: Job, hosts: Sequence[Host], phase: str = "status"
) -> list[StatusRow]:
    """One row per node; a node that cannot be asked is ``absent`` with the reason. Every row
    says whether the job is stalled."""
    replies = pool.call_all(
        phase, lambda h: p.StatusRequest(job.id, job.log(hosts.index(h))), p.StatusReply
    )
    rows = []
    for rank, h in enumerate(hosts):
        outcome = replies.get(h)
        if outcome is None or outcome.value is None:
            error = unanswered(outcome, h, pool.failures)
            rows.append(StatusRow(rank, h.label, "absent", None, None, f"error: {error}", error))
            continue
        r = outcome.value
        utc = datetime.datetime.fromtimestamp(r.started or 0, datetime.timezone.utc).isoformat()
        started = utc if r.started else None
        row = StatusRow(rank, h.label, r.state, r.exit_code, started, r.last_line, idle_s=r.idle)
        rows.append(row)
    stalled = is_stalled(job.stall_after, [(r.state, r.idle_s) for r in rows if not r.error])
    return [replace(r, stalled=stalled) for r in rows] if stalled else rows


def wait_done(pool: NodePool, job: Job, hosts: Sequence[Host], timeout: float) -> list[StatusRow]:
    """Poll status until no node is running (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = status(pool, job, hosts, phase="")
        if all(r.state != "running" for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(1.0)


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
    replies = pool.call_all("stop", lambda h: p.StopRequest(job.id), p.StopReply, hosts)
    rows = []
    for rank, h in enumerate(hosts):
        outcome = replies.get(h)
        if outcome is None or outcome.value is None:
            error = unanswered(outcome, h, pool.failures)
            rows.append(StopRow(rank, h.label, False, 0, [], error))
        else:
            r = outcome.value
            rows.append(StopRow(rank, h.label, r.found, r.signalled, r.left, None))
    return rows


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
            lambda h: p.LogsRequest(job.log(hosts.index(h)), lines, offsets.get(h)),
            p.LogsReply,
            [hosts[r] for r in ranks],
        )
        chunks = []
        for rank in ranks:
            h, outcome = hosts[rank], replies.get(hosts[rank])
            if outcome is None or outcome.value is None:
                if h not in offsets:
                    chunks.append(LogChunk(rank, [], unanswered(outcome, h, pool.failures)))
                continue
            offsets[h] = outcome.value.offset
            chunks.append(LogChunk(rank, outcome.value.lines))
        yield chunks
        phase = ""  # the progress line once, not every poll
        time.sleep(FOLLOW)
