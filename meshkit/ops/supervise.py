"""Supervised jobs (``train --restarts N``): a supervisor on every node of the job, the lowest-
ranked live one leading, so the reboot of any one node (the launching one and the master
included) leaves the job supervised. The leader watches every node; on a failure it waits for
every node to answer, claims the next attempt in the record (compare-and-set on every node: two
supervisors never relaunch at once), stops the job, waits while the doctor's quick checks fail,
and relaunches it with the same ranks, at most N times. The policy is pure (``decide``,
``next_step``, ``newest``); ``Supervisor`` is the loop around it (it prints nothing: it reports
through ``say``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Final, Literal

from ..errors import LaunchError, MeshkitError, RemoteError, UsageError
from ..hostfile import Host
from ..job import Job
from ..node.supervise import beat, register
from ..protocol import StopReply, StopRequest, SupervisorReply, SupervisorRequest
from ..record import build, replace
from . import jobs as ops
from .pool import NodePool

POLL_INTERVAL = 2.0  # seconds between polls of every node
FOLLOWER_POLLS = 3  # a follower polls every 3rd interval: all at every one is N² requests
MISSES = 2  # consecutive unanswered polls before a node counts as gone (one blip is no failure)
COME_BACK = 300.0  # seconds a relaunch waits for every node to answer, then for its checks
BACKOFF = 2.0  # seconds before the first relaunch, doubled for each later one
MAX_BACKOFF = 60.0
GIVE_UP_GRACE = 30.0  # seconds the nodes still running get to end by themselves after a give-up
STALE = 60.0  # a supervisor whose heartbeat is older is gone: longer than any step between two
# beats (the doctor's quick checks take up to about 35 s, one connection try RECONNECT)
RECONNECT = 10.0  # seconds between new connections while some node does not answer

# The record's states (DESIGN.md, Supervision): RUNNING -> RELAUNCHING (the next attempt claimed)
# -> RUNNING ..., ending in GAVE_UP or DONE. NOT_RESPONDING is what status shows for a RUNNING or
# RELAUNCHING record when no node has a live supervisor; it is never written.
RUNNING: Final = "running"
RELAUNCHING: Final = "relaunching"
GAVE_UP: Final = "gave up"
DONE: Final = "done"
NOT_RESPONDING: Final = "not responding"


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
        stamp = datetime.datetime.fromisoformat(r.started).timestamp() if r.started else None
        out.append(NodeView(r.node_rank, r.host, r.state, r.exit_code, stamp))
    return out


@dataclass(frozen=True)
class Record:
    """The job's supervision, as status shows it. Every write bumps ``version``; a node keeps a
    write only over a copy no newer than the one the writer read (compare-and-set), and readers
    take the newest copy, so a node that was down (its copy gone with its /tmp) costs nothing."""

    supervisor: Literal["running", "relaunching", "gave up", "done"]
    attempt: int
    restarts_left: int
    last_restart_reason: str | None = None
    exit_codes: list[int | None] = field(default_factory=list)  # the last attempt's, per rank
    version: int = 0
    by: int = 0  # the rank whose supervisor wrote it (of a RELAUNCHING record: the claimer)
    held: str | None = None  # what holds the relaunch: "NODE: CHECK: DETAIL"
    diagnosis: str | None = None  # `diagnose --json` saved before the last stall restart

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"


def record_from_json(text: str | None) -> Record | None:
    """The record, or None when there is none or it is unreadable."""
    try:
        return build(Record, json.loads(text or "null"), "supervision record")
    except ValueError:
        return None


def newest(texts: Iterable[str | None]) -> Record | None:
    """Pure: the newest readable copy."""
    records = [r for r in map(record_from_json, texts) if r is not None]
    return max(records, key=lambda r: r.version, default=None)


def alive(reply: SupervisorReply) -> bool:
    """A supervisor that runs and beat within ``STALE`` s (its own node's clock: no skew)."""
    return reply.pid is not None and reply.beat is not None and reply.beat <= STALE


Step = Literal["end", "follow", "watch", "resume"]


def next_step(me: int, live: set[int], record: Record | None) -> Step:
    """Pure: what the supervisor of rank ``me`` does, given the ranks whose supervisors are live
    and the newest record. A claimed relaunch is finished by its claimer while that one lives,
    else by the leader (the lowest live rank); it is never begun anew."""
    if record is None or record.supervisor in (DONE, GAVE_UP):
        return "end"
    if record.supervisor == RELAUNCHING and record.by in live:
        return "resume" if record.by == me else "follow"
    if min(live | {me}) != me:
        return "follow"
    return "resume" if record.supervisor == RELAUNCHING else "watch"


Connect = Callable[[float], AbstractContextManager[NodePool]]
Gate = Callable[[NodePool, Job, Sequence[Host]], list[str]]  # one line per failed check
Answers = dict[Host, SupervisorReply]
# the record read, and the claim to write (the same record: take over the claimed relaunch)
Restart = tuple[Record, Record]


def health(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[str]:
    """The doctor's quick checks on every node: the failures, as "NODE: CHECK: DETAIL"."""
    from .doctor import quick

    return [f"{c.node}: {c.check}: {c.detail}" for c in quick(pool, job, hosts).failures]


def ask(pool: NodePool, job: Job, hosts: Sequence[Host], **kw: str | int) -> Answers:
    """The ``supervisor`` op on ``hosts``: the replies of the nodes that answered."""
    request = SupervisorRequest(job.id, job.supervisor_tmux, **kw)  # type: ignore[arg-type]
    replies = pool.call_all("supervisor", lambda h: request, SupervisorReply, hosts)
    return {h: o.value for h, o in replies.items() if o.value is not None}


def write(
    pool: NodePool, job: Job, hosts: Sequence[Host], record: Record, by: int, every: bool = False
) -> Record | None:
    """Compare-and-set ``record`` (one version on, written by rank ``by``) on the nodes: the
    lowest-ranked connected node first (it decides between two writers), then the rest at once.
    None: a node holds a newer copy (another supervisor moved on), or (``every``) some node did
    not answer."""
    new = replace(record, version=record.version + 1, by=by)
    up = [h for h in hosts if h not in pool.failures]
    kw: dict[str, str | int] = {"record": new.to_json(), "version": record.version}
    first = ask(pool, job, up[:1], **kw)
    if not first or not all(r.written for r in first.values()):
        return None
    got = first | ask(pool, job, up[1:], **kw)
    if not all(r.written for r in got.values()) or (every and len(got) < len(hosts)):
        return None
    return new


@dataclass
class Supervisor:
    """The supervisor of rank ``me``. ``run`` returns the final record (or, when the record is
    gone because the job was stopped, a ``gave up`` one that says so)."""

    connect: Connect
    job: Job
    hosts: Sequence[Host]
    me: int
    say: Callable[[str], None]
    interval: float = POLL_INTERVAL
    base_backoff: float = BACKOFF
    relaunch: Callable[[NodePool, Job, int], ops.Launch] | None = None
    gate: Gate = health

    def run(self) -> Record:
        while True:
            with self.connect(0.0) as pool:
                outcome = self._serve(pool)
            if isinstance(outcome, Record):
                return outcome
            final = self._relaunch(*outcome) if outcome else None
            if final is not None:
                return final
            time.sleep(self.interval)

    def _look(self, pool: NodePool) -> tuple[set[int], Record | None, int]:
        """Beat; then the live supervisors (ranks), the newest record, how many nodes answered."""
        beat(self.job.id)
        got = ask(pool, self.job, self.hosts)
        live = {i for i, h in enumerate(self.hosts) if h in got and alive(got[h])}
        return live | {self.me}, newest(r.record for r in got.values()), len(got)

    def _write(self, pool: NodePool, record: Record, every: bool = False) -> Record | None:
        return write(pool, self.job, self.hosts, record, self.me, every)

    def _serve(self, pool: NodePool) -> Record | Restart | None:
        """Follow or lead on this pool. Returns the final record, a restart to make, or None for
        a new connection (a node that did not answer may be back)."""
        started: dict[int, float] = {}
        misses: dict[int, int] = {}
        attempt, since = 0, time.monotonic()
        while True:
            live, record, answered = self._look(pool)
            # a node that did not answer (never connected, or its channel died with a reboot)
            # may be back by now: look through a new connection
            late = time.monotonic() - since > RECONNECT
            if not answered or (answered < len(self.hosts) and late):
                return None
            step = next_step(self.me, live, record)
            if record is None:  # every copy is gone: the job was stopped
                return Record(GAVE_UP, 0, 0, "the supervision record is gone (meshkit stop)")
            if step in ("end", "resume"):
                return record if step == "end" else (record, record)
            if step == "follow":
                started.clear()
                misses.clear()
                time.sleep(self.interval * FOLLOWER_POLLS)
                continue
            if record.attempt != attempt:
                started.clear()
                attempt = record.attempt
            rows = ops.status(pool, self.job, self.hosts, phase="")
            seen = views(rows, misses)
            for n in seen:
                if n.started is not None:
                    started.setdefault(n.rank, n.started)
            stalled = None
            if self.job.restart_on_stall and any(r.stalled for r in rows):
                stalled = f"the job stalled: no output for {self.job.stall_after:.0f}s"
                stalled += " (--stall-after)"
            decision = decide(seen, started, self.job.restart_on, record.restarts_left, stalled)
            codes, saved = [n.exit_code for n in seen], None
            if stalled and stalled in str(decision.reason):
                saved, decision = _save_diagnosis(pool, self.job, self.hosts, record, decision)
                self.say(f"saved the diagnosis: {saved}")
            kept = replace(record, exit_codes=codes, diagnosis=saved or record.diagnosis)
            if decision.action == "wait":
                time.sleep(self.interval)
            elif decision.action == DONE:
                final = self._write(pool, replace(kept, supervisor=DONE))
                if final is not None:
                    self.say("done: every node exited 0")
                    return final
            elif decision.action == GAVE_UP:
                return self._give_up(pool, kept, seen, decision.reason or "")
            else:
                why, left = decision.reason, record.restarts_left - 1
                claim = replace(kept, supervisor=RELAUNCHING, last_restart_reason=why)
                return (record, replace(claim, attempt=record.attempt + 1, restarts_left=left))

    def _give_up(self, pool: NodePool, record: Record, seen: list[NodeView], why: str) -> Record:
        # The other nodes usually fail on their own within seconds (torchrun notices a lost
        # peer): give them a while, so status shows the codes they really ended with.
        job, hosts = self.job, self.hosts
        still = [hosts[n.rank] for n in seen if n.state == RUNNING]
        deadline = time.monotonic() + GIVE_UP_GRACE
        while still and time.monotonic() < deadline:
            time.sleep(self.interval)
            rows = ops.status(pool, job, hosts, phase="")
            still = [hosts[r.node_rank] for r in rows if r.state == RUNNING and not r.error]
        if still:  # keep_exit: status shows the exit codes they were ended with
            ending = StopRequest(job.id, keep_exit=True)
            pool.call_all("stop", lambda h: ending, StopReply, still)
        codes = [r.exit_code for r in ops.status(pool, job, hosts, phase="")]
        return self._gave_up(pool, replace(record, exit_codes=codes), why)

    def _gave_up(self, pool: NodePool, record: Record, why: str) -> Record:
        self.say(f"gave up: {why}")
        given = replace(record, supervisor=GAVE_UP, last_restart_reason=why)
        return self._write(pool, given) or given

    @contextlib.contextmanager
    def _every_node(self) -> Iterator[NodePool]:
        """A pool once every node answers (trying again every ``RECONNECT`` s, beating between),
        or, after ``COME_BACK`` s, the pool as it is."""
        deadline = time.monotonic() + COME_BACK
        while True:
            beat(self.job.id)
            wait = min(RECONNECT, max(0.0, deadline - time.monotonic()))
            with self.connect(wait) as pool:
                if not pool.failures or time.monotonic() >= deadline:
                    yield pool
                    return

    def _relaunch(self, seen: Record, claim: Record) -> Record | None:
        """Claim the next attempt (``claim`` over ``seen``; the same record: take the claimed one
        over), and make it: every node answering, the job stopped everywhere, the health gate,
        the launch, then a supervisor on every node again. Returns the final record when it gives
        up; None when it is back to watching, or another supervisor moved on first."""
        job, hosts, say = self.job, self.hosts, self.say
        if claim is not seen:
            say(f"attempt {seen.attempt} failed: {claim.last_restart_reason}")
            time.sleep(backoff(seen.attempt, self.base_backoff))
        with self._every_node() as pool:
            live, record, _ = self._look(pool)
            if record != seen or next_step(self.me, live, record) not in ("watch", "resume"):
                return None
            missing = [h.label for h in hosts if h in pool.failures]
            if missing:
                why = f"{claim.last_restart_reason}; then {', '.join(missing)} did not "
                return self._gave_up(pool, seen, why + f"answer within {COME_BACK:.0f}s")
            claimed = self._write(pool, claim, every=True)
            if claimed is None:
                say("another supervisor moved on first; following it")
                return None
            attempt = claimed.attempt
            say(f"attempt {attempt}: relaunching (of {job.restarts + 1}); stopping the job")
            ops.stop(pool, job, hosts)
            deadline = time.monotonic() + COME_BACK
            while held := self.gate(pool, job, hosts):
                if time.monotonic() > deadline:
                    why = f"the relaunch was held for {COME_BACK:.0f}s by {held[0]}"
                    return self._gave_up(pool, claimed, why)
                if claimed.held != held[0]:
                    say(f"attempt {attempt}: held by {held[0]}")
                    if (claimed := self._write(pool, replace(claimed, held=held[0]))) is None:
                        return None
                beat(job.id)
                time.sleep(self.interval)
            # The claim renewed right before the launch: a supervisor that hung while another
            # took this attempt over finds a newer copy here and launches nothing.
            claimed = self._write(pool, replace(claimed, held=None))
            if claimed is None:
                say(f"attempt {attempt}: another supervisor took it over; following it")
                return None
            try:
                relaunch = self.relaunch or (lambda p, j, a: ops.launch(p, j, hosts, attempt=a))
                launched = relaunch(pool, job, attempt)
                ok = launched.ok
                why = "; ".join(f"node {r.node_rank}: {r.error}" for r in launched.rows if r.error)
            except (LaunchError, RemoteError) as exc:
                ok, why = False, str(exc).replace("\n", "; ")
            if not ok:  # a failed attempt: the next poll sees the nodes absent and decides
                say(f"attempt {attempt} did not start: {why}")
            if self._write(pool, replace(claimed, supervisor=RUNNING, held=None)) is None:
                return None
            say(f"attempt {attempt} started")
            start_all(pool, job, hosts)  # where none is live: a rebooted node's comes back
        return None


def _save_diagnosis(
    pool: NodePool, job: Job, hosts: Sequence[Host], record: Record, decision: Decision
) -> tuple[str, Decision]:
    """Before a stalled job is stopped: its diagnosis (every rank's stack) into the job's
    directory (every node's copy of it when synced), where it outlives the restart; the reason
    names the outliers."""
    from .diagnose import diagnose, spans

    found = diagnose(pool, job, hosts)
    path = str(job.home / f"diagnosis-{record.attempt}.json")
    for h in hosts if job.sync else hosts[:1]:
        with contextlib.suppress(MeshkitError):  # the restart goes on without it
            pool.write_file(h, path, json.dumps(found.as_json(), indent=1) + "\n")
    odd = f"rank {spans(found.outliers)}" if found.outliers else "none"
    return path, replace(decision, reason=f"{decision.reason}; outliers: {odd} (diagnosis: {path})")


def start_all(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[str]:
    """A supervisor in tmux on every node where none is live (``meshkit supervise``, its output
    in ``supervisor-node<rank>.log``). Returns the nodes it failed on."""

    def start(h: Host) -> SupervisorRequest:
        rank = hosts.index(h)
        argv = [
            *(job.python, "-m", "meshkit", "supervise"),
            *("--hostfile", job.node_hostfile, "--session", job.session, "--workdir", job.workdir),
            *("--rank", str(rank), "--log", str(job.home / f"supervisor-node{rank}.log")),
        ]
        return SupervisorRequest(job.id, job.supervisor_tmux, "start", argv)

    replies = pool.call_all("supervisor", start, SupervisorReply, hosts)
    failed = [f"{h.label}: {o.error}" for h, o in replies.items() if o.value is None]
    return failed + [f"{h.label}: {why}" for h, why in pool.failures.items() if h in hosts]


def end_supervisor(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[str]:
    """End the job's supervisors on every node (and drop their record copies), before the job
    itself is touched (one would take a stop for a failure and relaunch). Looked at again until
    a round finds none: a leader ended mid-relaunch may have started one meanwhile. Returns the
    nodes where one survived."""
    for _ in range(3):
        got = ask(pool, job, hosts, action="end")
        left = [f"{h.label}: supervisor pid {r.left} survived" for h, r in got.items() if r.left]
        if left or all(r.pid is None for r in got.values()):
            return left
    return []


def with_supervision(
    job: Job, rows: list[ops.StatusRow], record: Record | None, leader: int | None
) -> list[ops.StatusRow]:
    """Pure: a supervised job's rows carry its record (all null when there is none, e.g. after
    ``stop``) and its leader; a record no live supervisor backs says "not responding"."""
    if not job.restarts:
        return rows
    if record is None:
        return [replace(r, supervised=True) for r in rows]
    state: ops.SupervisorState = record.supervisor
    reason = record.last_restart_reason
    if state not in (RUNNING, RELAUNCHING):
        leader = None  # nobody supervises an ended job (its supervisors are on their way out)
    elif leader is None:
        state = NOT_RESPONDING
        reason = (
            "no node has a live supervisor (each was ended, or its node rebooted); "
            "`meshkit train` relaunches the job under new ones"
        )
    return [
        replace(
            r,
            supervised=True,
            attempt=record.attempt,
            restarts_left=record.restarts_left,
            last_restart_reason=reason,
            supervisor=state,
            leader=leader,
            held=record.held,
            diagnosis=record.diagnosis,
        )
        for r in rows
    ]


def status(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[ops.StatusRow]:
    """``meshkit status``: each node's row, with the supervision record and its leader."""
    rows = ops.status(pool, job, hosts)
    if not job.restarts:
        return rows
    got = ask(pool, job, hosts)
    leader = min((i for i, h in enumerate(hosts) if h in got and alive(got[h])), default=None)
    return with_supervision(job, rows, newest(r.record for r in got.values()), leader)


@dataclass(frozen=True)
class Stopped:
    """``meshkit stop``: each node's row, and the supervisors that could not be ended (then the
    job was still stopped)."""

    rows: list[ops.StopRow]
    supervisor_left: list[str]

    @property
    def ok(self) -> bool:
        return not self.supervisor_left and all(r.ok for r in self.rows)


def stop(pool: NodePool, job: Job, hosts: Sequence[Host]) -> Stopped:
    """End every supervisor first (each would take the stop for a failure), then the job."""
    left = end_supervisor(pool, job, hosts) if job.restarts else []
    return Stopped(ops.stop(pool, job, hosts), left)


def run(
    connect: Connect, job: Job, hosts: Sequence[Host], rank: int, say: Callable[[str], None]
) -> Record:
    """``meshkit supervise`` (what ``train --restarts`` starts in tmux on every node): register
    here (the pid file is the heartbeat), then follow or lead until the job ends."""
    if not 0 <= rank < len(hosts):
        raise UsageError(f"--rank {rank}: the job has ranks 0..{len(hosts) - 1}")
    register(job.id)
    say(f"supervising {job.label} from node {rank}, restarts {job.restarts}")
    record = Supervisor(connect, job, hosts, rank, say).run()
    say(f"ending: the job's supervision is {record.supervisor}")
    return record
