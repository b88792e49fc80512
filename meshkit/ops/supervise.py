"""Supervised jobs (``train --restarts N``): watch every node, and on a failure stop the job
everywhere, wait for every node to answer again, and relaunch it with the same ranks, at most N
times. ``decide`` is the whole policy, pure; ``supervise`` is the loop around it (prints nothing:
it reports through ``say`` and records its state through ``save``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Final, Literal

from ..errors import LaunchError, MeshkitError, RemoteError
from ..hostfile import Host
from ..job import Job
from ..record import replace
from . import jobs as ops
from .pool import NodePool

POLL_INTERVAL = 2.0  # seconds between status polls of every node
MISSES = 2  # consecutive unanswered polls before a node counts as gone (one blip is no failure)
COME_BACK = 300.0  # seconds to wait for every node to answer again before a relaunch
BACKOFF = 2.0  # seconds before the first relaunch, doubled for each later one
MAX_BACKOFF = 60.0
GIVE_UP_GRACE = 30.0  # seconds the nodes still running get to end by themselves after a give-up

HEARTBEAT = 15.0  # seconds between the running supervisor's record writes while it waits
STALE = 120.0  # a running record older than this: its supervisor is gone (clocks may differ)

# A supervisor's states. It starts RUNNING and ends in GAVE_UP or DONE (each written to its
# record); NOT_RESPONDING is what status shows for a RUNNING record gone stale, never written.
State = ops.SupervisorState
RUNNING: Final = "running"
GAVE_UP: Final = "gave up"
DONE: Final = "done"
NOT_RESPONDING: Final = "not responding"


# ---- the policy (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class NodeView:
    """One node as the supervisor sees it in one poll."""

    rank: int
    host: str
    state: Literal["running", "exited", "absent", "unreachable"]
    exit_code: int | None = None
    started: float | None = None


@dataclass(frozen=True)
class Decision:
    action: Literal["wait", "done", "restart", "gave up"]
    reason: str | None = None


def restartable(code: int, restart_on: Sequence[int]) -> bool:
    """Whether ``code`` restarts the job: any non-zero by default, else only the listed codes."""
    return code != 0 and (not restart_on or code in restart_on)


def decide(
    nodes: Sequence[NodeView],
    started: dict[int, float],
    restart_on: Sequence[int],
    restarts_left: int,
    stalled: str | None = None,
) -> Decision:
    """What to do after one poll. ``started`` is when each node's part of this attempt started
    (as first seen): a different start time means the node ran something else since (a reboot
    and someone's relaunch, say). ``stalled``: why the job counts as stalled (--restart-on-stall),
    a failure like any other."""
    if nodes and all(n.state == "exited" and n.exit_code == 0 for n in nodes):
        return Decision(DONE, "every node exited 0")
    problems: list[str] = []
    fatal: list[str] = []
    for n in nodes:
        who = f"node {n.rank} ({n.host})"
        if n.state == "unreachable":
            problems.append(f"{who} is not answering")
        elif n.state == "absent":
            problems.append(f"{who}: the job is gone there (rebooted, or ended outside meshkit)")
        elif n.rank in started and n.started is not None and n.started != started[n.rank]:
            problems.append(f"{who}: the job was restarted outside the supervisor")
        elif n.state == "exited" and n.exit_code not in (0, None):
            if restartable(n.exit_code, restart_on):
                problems.append(f"{who} exited with code {n.exit_code}")
            else:
                fatal.append(f"{who} exited with code {n.exit_code} (not in --restart-on)")
    if stalled and not problems:
        problems.append(stalled)
    if fatal:
        return Decision(GAVE_UP, "; ".join(fatal + problems))
    if not problems:
        return Decision("wait")
    reason = "; ".join(problems)
    if restarts_left <= 0:
        return Decision(GAVE_UP, f"no restarts left; last failure: {reason}")
    return Decision("restart", reason)


def backoff(restart_number: int, base: float = BACKOFF, cap: float = MAX_BACKOFF) -> float:
    """Seconds to wait before relaunch number ``restart_number`` (1, 2, ...)."""
    return float(min(cap, base * 2 ** max(0, restart_number - 1)))


def views(rows: Sequence[ops.StatusRow], misses: dict[int, int]) -> list[NodeView]:
    """Status rows as the policy sees them: a node that did not answer ``MISSES`` polls in a row
    is ``unreachable``; before that it is taken to be as it was (``running``)."""
    out = []
    for r in rows:
        if r.error:
            misses[r.node_rank] = misses.get(r.node_rank, 0) + 1
            gone = misses[r.node_rank] >= MISSES
            out.append(NodeView(r.node_rank, r.host, "unreachable" if gone else RUNNING))
            continue
        misses.pop(r.node_rank, None)
        stamp = None
        if r.started:
            import datetime

            stamp = datetime.datetime.fromisoformat(r.started).timestamp()
        out.append(NodeView(r.node_rank, r.host, r.state, r.exit_code, stamp))
    return out


# ---- the record every node can read ---------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """What ``status`` shows about supervision (``supervisor.json`` beside the job file)."""

    supervisor: State
    attempt: int
    restarts_left: int
    last_restart_reason: str | None = None
    host: str | None = None  # where the supervisor runs (its tmux session is there)
    exit_codes: list[int | None] = field(default_factory=list)  # the last attempt's, per rank
    heartbeat: float | None = None  # when a running supervisor last wrote this (its clock)
    diagnosis: str | None = None  # `diagnose --json` saved before the last stall restart

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def record_from_json(text: str | None) -> Record | None:
    """The record, or None when there is none or it is unreadable (status then shows null)."""
    if not text:
        return None
    try:
        data = json.loads(text)
        state = data["supervisor"]
        if state not in (RUNNING, GAVE_UP, DONE):
            return None
        record = Record(
            supervisor=state,
            attempt=int(data["attempt"]),
            restarts_left=int(data["restarts_left"]),
            last_restart_reason=(
                None
                if data.get("last_restart_reason") is None
                else str(data["last_restart_reason"])
            ),
            host=None if data.get("host") is None else str(data["host"]),
            exit_codes=[None if c is None else int(c) for c in data.get("exit_codes") or []],
            heartbeat=None if data.get("heartbeat") is None else float(data["heartbeat"]),
            diagnosis=None if data.get("diagnosis") is None else str(data["diagnosis"]),
        )
    except (ValueError, TypeError, KeyError):
        return None
    return record


def seen_alive(record: Record, now: float) -> Record:
    """Pure: a record that says running but has not been rewritten for ``STALE`` seconds belongs
    to a supervisor that is gone (its machine rebooted, or it was killed): status must not say
    "running" for it."""
    if record.supervisor != RUNNING or record.heartbeat is None:
        return record
    if now - record.heartbeat <= STALE:
        return record
    ago = now - record.heartbeat
    return replace(
        record,
        supervisor=NOT_RESPONDING,
        last_restart_reason=(
            f"its record on {record.host or '?'} was last written {ago:.0f}s ago (that machine "
            "rebooted, or the supervisor was killed); `meshkit train` relaunches the job under a "
            "new one"
        ),
    )


# ---- the loop -------------------------------------------------------------------------------


Connect = Callable[[float], AbstractContextManager[NodePool]]


def supervise(
    connect: Connect,
    job: Job,
    hosts: Sequence[Host],
    *,
    save: Callable[[NodePool, Record], None],
    say: Callable[[str], None],
    host: str,
    interval: float = POLL_INTERVAL,
    come_back: float = COME_BACK,
    base_backoff: float = BACKOFF,
    relaunch: Callable[[NodePool, Job, int], ops.Launch] | None = None,
) -> Record:
    """Watch attempt 1 (already started) and relaunch on failure; returns the final record.

    ``connect(wait)`` opens one agent per node (waiting up to ``wait`` seconds for nodes that do
    not answer yet); the same pool is reused for every poll until a node stops answering."""
    relaunch = relaunch or (lambda pool, j, attempt: ops.launch(pool, j, hosts, attempt=attempt))
    record = Record(RUNNING, 1, job.restarts, None, host)
    while True:
        with connect(0.0) as pool:
            record = _beat(pool, record, save)
            record = _watch(pool, job, hosts, record, save, say, interval)
        if record.supervisor != RUNNING:
            return record
        # A restart: the job was stopped everywhere that answered; now every node must answer.
        attempt = record.attempt + 1
        pause = backoff(attempt - 1, base_backoff)
        say(f"attempt {record.attempt} failed: {record.last_restart_reason}")
        say(f"relaunching in {pause:.0f}s (attempt {attempt} of {job.restarts + 1})")
        time.sleep(pause)
        with connect(come_back) as pool:
            missing = [h.label for h in hosts if h in pool.failures]
            if missing:
                record = replace(
                    record,
                    supervisor=GAVE_UP,
                    last_restart_reason=(
                        f"{record.last_restart_reason}; then {', '.join(missing)} did not answer "
                        f"within {come_back:.0f}s"
                    ),
                )
                save(pool, record)
                say(f"gave up: {record.last_restart_reason}")
                return record
            record = replace(record, attempt=attempt, restarts_left=record.restarts_left - 1)
            try:
                launched = relaunch(pool, job, attempt)
                ok = launched.ok
                why = "; ".join(f"node {r.node_rank}: {r.error}" for r in launched.rows if r.error)
            except (LaunchError, RemoteError) as exc:
                ok, why = False, str(exc).replace("\n", "; ")
            if not ok:
                say(f"attempt {attempt} did not start: {why}")
                # Counted as a failed attempt: the next poll sees the nodes absent and decides.
            record = _beat(pool, record, save)
            say(f"attempt {attempt} started")


def _watch(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    record: Record,
    save: Callable[[NodePool, Record], None],
    say: Callable[[str], None],
    interval: float,
) -> Record:
    """Poll until the attempt ends: done, gave up, or a restart (the job then stopped)."""
    started: dict[int, float] = {}
    misses: dict[int, int] = {}
    while True:
        if record.heartbeat is None or time.time() - record.heartbeat >= HEARTBEAT:
            record = _beat(pool, record, save)
        rows = ops.status(pool, job, hosts, phase="")
        seen = views(rows, misses)
        for n in seen:
            if n.started is not None:
                started.setdefault(n.rank, n.started)
        stalled = None
        if job.restart_on_stall and any(r.stalled for r in rows):
            stalled = f"the job stalled: no output for {job.stall_after:.0f}s (--stall-after)"
        decision = decide(seen, started, job.restart_on, record.restarts_left, stalled)
        codes = [n.exit_code for n in seen]
        if decision.action == "wait":
            time.sleep(interval)
            continue
        if decision.action == DONE:
            record = replace(record, supervisor=DONE, exit_codes=codes)
            save(pool, record)
            say("done: every node exited 0")
            return record
        # A failure: end the job everywhere (keeping exit codes when giving up).
        if stalled and stalled in str(decision.reason):
            record, decision = _save_diagnosis(pool, job, hosts, record, decision, say)
        give_up = decision.action == GAVE_UP
        still = [hosts[n.rank] for n in seen if n.state == RUNNING]
        if give_up:
            # The other nodes usually fail on their own within seconds (torchrun notices a lost
            # peer): give them a while, so status shows the codes they really ended with.
            deadline = time.monotonic() + GIVE_UP_GRACE
            while still and time.monotonic() < deadline:
                time.sleep(interval)
                rows = ops.status(pool, job, hosts, phase="")
                still = [hosts[r.node_rank] for r in rows if r.state == RUNNING and not r.error]
            if still:
                ops.stop(pool, job, hosts, keep_exit=True, only=still)
            rows = ops.status(pool, job, hosts, phase="")
            codes = [r.exit_code for r in rows]
            record = replace(
                record,
                supervisor=GAVE_UP,
                last_restart_reason=decision.reason,
                exit_codes=codes,
            )
            save(pool, record)
            say(f"gave up: {decision.reason}")
            return record
        ops.stop(pool, job, hosts)
        return replace(record, last_restart_reason=decision.reason, exit_codes=codes)


def _save_diagnosis(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    record: Record,
    decision: Decision,
    say: Callable[[str], None],
) -> tuple[Record, Decision]:
    """Before a stalled job is stopped: its diagnosis (every rank's stack) into the job's
    directory, where it outlives the restart; the reason names the outliers."""
    from .diagnose import diagnose, spans

    found = diagnose(pool, job, hosts)
    path = str(job.home / f"diagnosis-{record.attempt}.json")
    for h in record_hosts(job, hosts):
        try:
            pool.write_file(h, path, json.dumps(found.as_json(), indent=1) + "\n")
        except MeshkitError as exc:
            say(f"{h.label}: cannot save the diagnosis: {exc}")
    odd = f"rank {spans(found.outliers)}" if found.outliers else "none"
    reason = f"{decision.reason}; outliers: {odd} (diagnosis: {path})"
    return replace(record, diagnosis=path), replace(decision, reason=reason)


def _beat(pool: NodePool, record: Record, save: Callable[[NodePool, Record], None]) -> Record:
    """Write the running record with a fresh heartbeat (status takes a stale one as gone)."""
    record = replace(record, heartbeat=time.time())
    save(pool, record)
    return record


# ---- starting and ending the supervisor -----------------------------------------------------


def supervisor_argv(job: Job, log: str) -> list[str]:
    return [
        job.python,
        "-m",
        "meshkit",
        "supervise",
        "--hostfile",
        job.hostfile,
        "--session",
        job.session,
        "--workdir",
        job.workdir,
        "--log",
        log,
    ]


def start_local(job: Job, log: str) -> str | None:
    """Start the supervisor detached in its own tmux session on this machine (it outlives the
    user's login), its output appended to ``log``. Returns an error, or None."""
    import os

    from ..node import tmux

    os.makedirs(os.path.dirname(log), exist_ok=True)
    tmux.kill_session(job.supervisor_tmux)
    try:
        # No shell in between: the supervisor opens its log itself (--log).
        tmux.new_session(job.supervisor_tmux, supervisor_argv(job, log))
    except tmux.TmuxError as exc:
        return str(exc)
    return None


def end_supervisor(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[str]:
    """End the job's supervisor wherever it runs (this machine or any node), before the job
    itself is touched (it would otherwise take a stop for a failure and relaunch). Returns the
    nodes where it could not be verified gone. This machine's is ended by the node side's own
    handler, called here: the controller is a machine like the nodes."""
    from ..node.supervise import unsupervise
    from ..protocol import UnsuperviseReply, UnsuperviseRequest

    request = UnsuperviseRequest(job.id, job.supervisor_tmux)
    problems = []
    local = unsupervise(request)
    if local.left:
        problems.append(f"this machine: supervisor pid {local.left} survived TERM and KILL")
    replies = pool.call_all("supervisor", lambda h: request, UnsuperviseReply, hosts)
    for h, outcome in replies.items():
        if outcome.value is not None and outcome.value.left:
            problems.append(f"{h.label}: supervisor pid {outcome.value.left} survived")
    return problems


def record_hosts(job: Job, hosts: Sequence[Host]) -> list[Host]:
    """Where the supervisor's record is written: the master (shared storage), or every node."""
    return list(hosts) if job.sync else list(hosts[:1])


# ---- what status shows ------------------------------------------------------------------------


def with_supervision(
    job: Job, rows: list[ops.StatusRow], record_text: str | None, now: float | None = None
) -> list[ops.StatusRow]:
    """Pure (given ``now``): a supervised job's rows carry its supervisor's record (all null when
    there is none, e.g. after ``stop``); a running record gone stale says "not responding"."""
    if not job.restarts:
        return rows
    record = record_from_json(record_text)
    if record is not None and now is not None:
        record = seen_alive(record, now)
    if record is None:
        return [replace(r, supervised=True) for r in rows]
    return [
        replace(
            r,
            supervised=True,
            attempt=record.attempt,
            restarts_left=record.restarts_left,
            last_restart_reason=record.last_restart_reason,
            supervisor=record.supervisor,
            diagnosis=record.diagnosis,
        )
        for r in rows
    ]


def status(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[ops.StatusRow]:
    """``meshkit status``: each node's row, with the supervisor's record when supervised."""
    from .lookup import read_local

    rows = ops.status(pool, job, hosts)
    return with_supervision(job, rows, read_local(str(job.supervisor_file)), time.time())


@dataclass(frozen=True)
class Stopped:
    """``meshkit stop``: each node's row, and the supervisors that could not be ended (then the
    job was still stopped, and their records were left as they were)."""

    rows: list[ops.StopRow]
    supervisor_left: list[str]

    @property
    def ok(self) -> bool:
        return not self.supervisor_left and all(r.ok for r in self.rows)


def stop(pool: NodePool, job: Job, hosts: Sequence[Host]) -> Stopped:
    """End the supervisor first (wherever it runs: it would take the stop for a failure and
    relaunch), then the job on every node; then clear the supervisor's record."""
    left = end_supervisor(pool, job, hosts) if job.restarts else []
    rows = ops.stop(pool, job, hosts)
    if job.restarts and not left:
        for h in record_hosts(job, hosts):
            with contextlib.suppress(MeshkitError):
                pool.write_file(h, str(job.supervisor_file), "{}\n")
    return Stopped(rows, left)


def run(connect: Connect, job: Job, hosts: Sequence[Host], say: Callable[[str], None]) -> Record:
    """``meshkit supervise`` (what ``train --restarts`` starts in tmux): register here, supervise,
    and write every record where status reads it. When the supervisor itself fails, it says so
    in its record (``gave up``, with why) before the error goes on."""
    import socket

    from ..node.supervise import register
    from .lookup import read_local

    register(job.id)
    host = socket.gethostname()

    def save(pool: NodePool, record: Record) -> None:
        for h in record_hosts(job, hosts):
            try:
                pool.write_file(h, str(job.supervisor_file), record.to_json())
            except Exception as exc:  # one node's record: say so, keep supervising
                say(f"{h.label}: cannot write the supervisor record: {exc}")

    say(f"supervising {job.label} on {len(hosts)} nodes, restarts {job.restarts}")
    try:
        return supervise(connect, job, hosts, save=save, say=say, host=host)
    except Exception as exc:
        last = None
        with contextlib.suppress(MeshkitError):
            last = record_from_json(read_local(str(job.supervisor_file)))
        record = Record(
            GAVE_UP,
            last.attempt if last else 1,
            last.restarts_left if last else job.restarts,
            f"the supervisor failed: {type(exc).__name__}: {exc}",
            host,
        )
        say(f"gave up: {record.last_restart_reason}")
        with connect(0.0) as pool:
            save(pool, record)
        raise
