"""Supervised jobs (``train --restarts N``): a supervisor on every node of the job, the lowest-
ranked live one leading, so the reboot of any one node (the launching one and the master
included) leaves the job supervised. The leader watches every node; on a failure it waits for
every node to answer, claims the next attempt in the record (compare-and-set on every node: two
supervisors never relaunch at once), stops the job, waits while the doctor's quick checks fail,
and relaunches it with the same ranks, at most N times. This module is the loop (``Supervisor``,
``run``); its policy is ``ops.supervision_policy``, its rounds over the nodes
``ops.supervision``. It prints nothing: it reports through ``say``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from ..errors import LaunchError, MeshkitError, RemoteError, UsageError
from ..hostfile import Host
from ..job import Job
from ..node.supervise import beat, register
from ..protocol import JobState, StopReply, StopRequest, Supervision, SupervisorState
from ..record import replace
from . import jobs as ops
from .pool import NodePool
from .supervision import ask, live_ranks, newest, start_all, write
from .supervision_policy import (
    BACKOFF,
    Action,
    Decision,
    NodeView,
    Step,
    backoff,
    decide,
    next_step,
    views,
)

POLL_INTERVAL = 2.0  # seconds between polls of every node
FOLLOWER_POLLS = 3  # a follower polls every 3rd interval: all at every one is N² requests
COME_BACK = 300.0  # seconds a relaunch waits for every node to answer, then for its checks
GIVE_UP_GRACE = 30.0  # seconds the nodes still running get to end by themselves after a give-up
RECONNECT = 10.0  # seconds between new connections while some node does not answer
BEAT_EVERY = 5.0  # seconds between heartbeats (well inside supervision.STALE)
HUNG = 900.0  # seconds a loop may go without a step before its heartbeat stops: longer than
# any one step it takes (a relaunch's two 300 s waits, its stop and launch)

Connect = Callable[[float], AbstractContextManager[NodePool]]
Gate = Callable[[NodePool, Job, Sequence[Host]], list[str]]  # one line per failed check
Launcher = Callable[[NodePool, Job, int], ops.Launch]


@dataclass(frozen=True)
class Restart:
    """A relaunch to make: the record ``seen`` and the ``claim`` to write over it. ``takeover``:
    ``seen`` is already a claimed relaunch (of a supervisor that is gone), which this one
    finishes: ``claim`` is then ``seen`` itself."""

    seen: Supervision
    claim: Supervision
    takeover: bool


@dataclass(frozen=True)
class Look:
    """One look at every node's supervisor: the ranks with a live one (this one included), the
    newest record, and how many nodes answered."""

    live: set[int]
    record: Supervision | None
    answered: int


@dataclass
class Heartbeat:
    """A supervisor's heartbeat, from a thread of its own every ``every`` s whatever the loop is
    doing: a relaunch (stop, health checks, launch, resync) may take longer than
    ``supervision.STALE``, and another supervisor must not take it for a hung one and take the
    attempt over. The loop marks each step (``moved``); one that has not moved for ``hung`` s is
    stuck past every bound its steps have, and then the beats stop, so it goes stale as a frozen
    one does."""

    job_id: str
    every: float = BEAT_EVERY
    hung: float = HUNG
    last_move: float = field(default_factory=time.monotonic)

    def moved(self) -> None:
        self.last_move = time.monotonic()

    @contextlib.contextmanager
    def beating(self) -> Iterator[Heartbeat]:
        register(self.job_id)
        done = threading.Event()

        def beat_on() -> None:
            while not done.wait(self.every):
                if time.monotonic() - self.last_move < self.hung:
                    beat(self.job_id)

        thread = threading.Thread(target=beat_on, name="heartbeat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()


def health(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[str]:
    """The doctor's quick checks on every node: the failures, as "NODE: CHECK: DETAIL"."""
    from .doctor import quick

    report = quick(pool, job, hosts)
    return [f"{check.node}: {check.check}: {check.detail}" for check in report.failures]


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
    relaunch: Launcher | None = None
    gate: Gate = health
    heart: Heartbeat | None = None  # None: nothing beats (the loop run on its own, in tests)

    def run(self) -> Supervision:
        while True:
            with self.connect(0.0) as pool:
                outcome = self._serve(pool)
            if isinstance(outcome, Supervision):
                return outcome
            final = None
            if outcome is not None:
                final = self._relaunch(outcome)
            if final is not None:
                return final
            time.sleep(self.interval)

    def _moved(self) -> None:
        """The loop took a step: its heartbeat goes on."""
        if self.heart is not None:
            self.heart.moved()

    def _look(self, pool: NodePool) -> Look:
        """Look at every node's supervisor."""
        self._moved()
        answers = ask(pool, self.job, self.hosts)
        live = live_ranks(self.hosts, answers)
        record = newest(reply.record for reply in answers.values())
        return Look(live | {self.me}, record, len(answers))

    def _write(
        self, pool: NodePool, record: Supervision, every: bool = False
    ) -> Supervision | None:
        return write(pool, self.job, self.hosts, record, self.me, every)

    def _serve(self, pool: NodePool) -> Supervision | Restart | None:
        """Follow or lead on this pool. Returns the final record, a restart to make, or None for
        a new connection (a node that did not answer may be back)."""
        started: dict[int, float] = {}
        misses: dict[int, int] = {}
        attempt = 0
        since = time.monotonic()
        while True:
            look = self._look(pool)
            record = look.record
            if not look.answered:
                return None
            if record is None:  # every copy is gone (a train dropped them to start anew)
                why = "the supervision record is gone from every node"
                return Supervision(SupervisorState.GAVE_UP, 0, 0, why)
            step = next_step(self.me, look.live, record)
            if step == Step.STOP:
                return self._carry_stop(pool, record)
            if step == Step.END:
                return record
            # a node that did not answer (never connected, or its channel died with a reboot)
            # may be back by now: look through a new connection
            late = time.monotonic() - since > RECONNECT
            if look.answered < len(self.hosts) and late:
                return None
            if step == Step.RESUME:
                return Restart(record, record, takeover=True)
            if step == Step.FOLLOW:
                started.clear()
                misses.clear()
                time.sleep(self.interval * FOLLOWER_POLLS)
                continue
            if record.attempt != attempt:
                started.clear()
                attempt = record.attempt
            rows = ops.status(pool, self.job, self.hosts, phase="")
            seen = views(rows, misses)
            for node in seen:
                if node.started is not None:
                    started.setdefault(node.rank, node.started)
            stalled = None
            if self.job.restart_on_stall and any(row.stalled for row in rows):
                stalled = f"the job stalled: no output for {self.job.stall_after:.0f}s"
                stalled += " (--stall-after)"
            left = record.restarts_left
            decision = decide(seen, started, self.job.restart_on, left, stalled)
            codes = [node.exit_code for node in seen]
            saved = None
            if stalled and stalled in str(decision.reason):
                saved, decision = _save_diagnosis(pool, self.job, self.hosts, record, decision)
                self.say(f"saved the diagnosis: {saved}")
            kept = replace(record, exit_codes=codes, diagnosis=saved or record.diagnosis)
            if decision.action == Action.WAIT:
                time.sleep(self.interval)
            elif decision.action == SupervisorState.DONE:
                final = self._write(pool, replace(kept, supervisor=SupervisorState.DONE))
                if final is not None:
                    self.say("done: every node exited 0")
                    return final
            elif decision.action == SupervisorState.GAVE_UP:
                return self._give_up(pool, kept, seen, decision.reason or "")
            else:
                claim = replace(
                    kept,
                    supervisor=SupervisorState.RELAUNCHING,
                    last_restart_reason=decision.reason,
                    attempt=record.attempt + 1,
                    restarts_left=record.restarts_left - 1,
                )
                return Restart(record, claim, takeover=False)

    def _carry_stop(self, pool: NodePool, stopped: Supervision) -> Supervision:
        """The job was stopped, and this supervisor survived it (cut off from ``stop``): the
        stop ends the whole job, so on the nodes whose copy does not say stopped yet (the stop
        did not reach them) leave the stop's record, then end the job there; relaunch
        nothing."""
        job = self.job
        answers = ask(pool, job, self.hosts)
        behind = [
            host
            for host, reply in answers.items()
            if reply.record is None or reply.record.supervisor != SupervisorState.STOPPED
        ]
        if not behind:
            self.say("the job was stopped (meshkit stop); relaunching nothing")
            return stopped
        where = ", ".join(host.label for host in behind)
        self.say(f"the job was stopped (meshkit stop) without reaching {where}: ending it there")
        ask(pool, job, behind, record=stopped, version=stopped.version)
        ending = StopRequest(job.id)
        pool.call_all("stop", lambda host: ending, StopReply, behind)
        return stopped

    def _give_up(
        self, pool: NodePool, record: Supervision, seen: list[NodeView], why: str
    ) -> Supervision:
        # The other nodes usually fail on their own within seconds (torchrun notices a lost
        # peer): give them a while, so status shows the codes they really ended with.
        job = self.job
        hosts = self.hosts
        still = [hosts[node.rank] for node in seen if node.state == JobState.RUNNING]
        deadline = time.monotonic() + GIVE_UP_GRACE
        while still and time.monotonic() < deadline:
            time.sleep(self.interval)
            rows = ops.status(pool, job, hosts, phase="")
            still = [
                hosts[row.node_rank]
                for row in rows
                if row.state == JobState.RUNNING and not row.error
            ]
        if still:  # keep_exit: status shows the exit codes they were ended with
            ending = StopRequest(job.id, keep_exit=True)
            pool.call_all("stop", lambda host: ending, StopReply, still)
        codes = [row.exit_code for row in ops.status(pool, job, hosts, phase="")]
        return self._gave_up(pool, replace(record, exit_codes=codes), why)

    def _gave_up(self, pool: NodePool, record: Supervision, why: str) -> Supervision:
        self.say(f"gave up: {why}")
        given = replace(record, supervisor=SupervisorState.GAVE_UP, last_restart_reason=why)
        return self._write(pool, given) or given

    @contextlib.contextmanager
    def _every_node(self) -> Iterator[NodePool]:
        """A pool once every node answers (trying again every ``RECONNECT`` s), or, after
        ``COME_BACK`` s, the pool as it is."""
        deadline = time.monotonic() + COME_BACK
        while True:
            self._moved()
            wait = min(RECONNECT, max(0.0, deadline - time.monotonic()))
            with self.connect(wait) as pool:
                if not pool.failures or time.monotonic() >= deadline:
                    yield pool
                    return

    def _relaunch(self, restart: Restart) -> Supervision | None:
        """Claim the next attempt (or take the claimed one over), and make it: every node
        answering, the job stopped everywhere, the health gate, the launch, then a supervisor
        on every node again. Returns the final record when it gives up; None when it is back to
        watching, or another supervisor moved on first."""
        job = self.job
        hosts = self.hosts
        say = self.say
        seen = restart.seen
        if not restart.takeover:
            say(f"attempt {seen.attempt} failed: {restart.claim.last_restart_reason}")
            time.sleep(backoff(seen.attempt, self.base_backoff))
        with self._every_node() as pool:
            look = self._look(pool)
            if look.record != seen:
                return None
            if next_step(self.me, look.live, look.record) not in (Step.WATCH, Step.RESUME):
                return None
            missing = [host.label for host in hosts if host in pool.failures]
            if missing:
                why = f"{restart.claim.last_restart_reason}; then {', '.join(missing)} did not "
                why += f"answer within {COME_BACK:.0f}s"
                return self._gave_up(pool, seen, why)
            claimed = self._write(pool, restart.claim, every=True)
            if claimed is None:
                say("another supervisor moved on first; following it")
                return None
            attempt = claimed.attempt
            say(f"attempt {attempt}: relaunching (of {job.restarts + 1}); stopping the job")
            ops.stop(pool, job, hosts)
            deadline = time.monotonic() + COME_BACK
            while True:
                held = self.gate(pool, job, hosts)
                if not held:
                    break
                if time.monotonic() > deadline:
                    why = f"the relaunch was held for {COME_BACK:.0f}s by {held[0]}"
                    return self._gave_up(pool, claimed, why)
                if claimed.held != held[0]:
                    say(f"attempt {attempt}: held by {held[0]}")
                    renewed = self._write(pool, replace(claimed, held=held[0]))
                    if renewed is None:
                        return None
                    claimed = renewed
                self._moved()
                time.sleep(self.interval)
            # The claim renewed right before the launch: a supervisor that hung while another
            # took this attempt over finds a newer copy here and launches nothing.
            renewed = self._write(pool, replace(claimed, held=None))
            if renewed is None:
                say(f"attempt {attempt}: another supervisor took it over; following it")
                return None
            claimed = renewed
            failure = self._launch(pool, attempt)
            if failure is not None:  # a failed attempt: the next poll sees the nodes absent
                say(f"attempt {attempt} did not start: {failure}")
            running = replace(claimed, supervisor=SupervisorState.RUNNING, held=None)
            if self._write(pool, running) is None:
                return None
            say(f"attempt {attempt} started")
            start_all(pool, job, hosts)  # where none is live: a rebooted node's comes back
        return None

    def _launch(self, pool: NodePool, attempt: int) -> str | None:
        """Launch ``attempt`` on every node; why it did not start (None: it did)."""
        try:
            if self.relaunch is not None:
                launched = self.relaunch(pool, self.job, attempt)
            else:
                launched = ops.launch(pool, self.job, self.hosts, attempt=attempt)
        except (LaunchError, RemoteError) as exc:
            return str(exc).replace("\n", "; ")
        if launched.ok:
            return None
        errors = [f"node {row.node_rank}: {row.error}" for row in launched.rows if row.error]
        return "; ".join(errors)


def _save_diagnosis(
    pool: NodePool, job: Job, hosts: Sequence[Host], record: Supervision, decision: Decision
) -> tuple[str, Decision]:
    """Before a stalled job is stopped: its diagnosis (every rank's stack) into the job's
    directory (every node's copy of it when synced), where it outlives the restart; the reason
    names the outliers. Returns where it was saved, and the decision with that reason."""
    from .diagnose import diagnose, spans

    found = diagnose(pool, job, hosts)
    path = str(job.home / f"diagnosis-{record.attempt}.json")
    text = json.dumps(found.as_json(), indent=1) + "\n"
    for host in job.home_copies(hosts):
        with contextlib.suppress(MeshkitError):  # the restart goes on without it
            pool.write_file(host, path, text, 0o600)  # stacks and paths: this user's only
    outliers = f"rank {spans(found.outliers)}" if found.outliers else "none"
    reason = f"{decision.reason}; outliers: {outliers} (diagnosis: {path})"
    return path, replace(decision, reason=reason)


def run(
    connect: Connect, job: Job, hosts: Sequence[Host], rank: int, say: Callable[[str], None]
) -> Supervision:
    """``meshkit supervise`` (what ``train --restarts`` starts in tmux on every node): register
    here, with a heartbeat in its pid file, then follow or lead until the job ends."""
    if not 0 <= rank < len(hosts):
        raise UsageError(f"--rank {rank}: the job has ranks 0..{len(hosts) - 1}")
    with Heartbeat(job.id).beating() as heart:
        say(f"supervising {job.label} from node {rank}, restarts {job.restarts}")
        record = Supervisor(connect, job, hosts, rank, say, heart=heart).run()
    say(f"ending: the job's supervision is {record.supervisor}")
    return record
