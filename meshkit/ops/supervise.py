"""Supervised jobs (``train --restarts N``): a supervisor on every node of the job, the lowest-
ranked live one leading, so the reboot of any one node (the launching one and the master
included) leaves the job supervised. The leader watches every node; on a failure it waits for
every node to answer, claims the next attempt in the record (compare-and-set on every node: two
supervisors never relaunch at once), stops the job, waits while the doctor's quick checks fail,
and relaunches it with the same ranks, at most N times. A node that does not answer within
``--replace-after`` is lost: its rank goes to a healthy spare (or, with ``--min-nodes``, the job
shrinks), in a new generation of the membership (``ops.membership``) that every supervisor then
follows, and that fences the lost node should it come back. This module is the loop
(``Supervisor``, ``run``); its policy is ``ops.supervision_policy``, its rounds over the nodes
``ops.supervision``. It prints nothing: it reports through ``say``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from ..errors import JobError, LaunchError, MeshkitError, RemoteError, UsageError
from ..hostfile import Host, members_text
from ..job import Job
from ..node.supervise import beat, register
from ..protocol import JobState, StopReply, StopRequest, Supervision, SupervisorState
from ..record import replace
from . import jobs as ops
from .membership import Change, members_of, plan, reason_of_change, spares_of
from .pool import NodePool
from .supervision import Answers, ask, believed, far_ahead, live_ranks, start_all, write
from .supervision_policy import (
    BACKOFF,
    Action,
    Decision,
    Heard,
    NodeView,
    Silence,
    Step,
    backoff,
    decide,
    next_step,
    restart_reason,
    views,
    waited_only,
)

POLL_INTERVAL = 2.0  # seconds between polls of every node
POLL_TIMEOUT = 15.0  # seconds a node gets to answer a poll: a powered-off node's connection
# does not fail, it goes silent, and the command timeout would hide the loss for minutes (the
# bound a node is lost after counts from the poll's start: ``Silence``)
FOLLOWER_POLLS = 3  # a follower polls every 3rd interval: all at every one is N² requests
COME_BACK = 300.0  # seconds a relaunch waits for every node to answer, then for its checks
GIVE_UP_GRACE = 30.0  # seconds the nodes still running get to end by themselves after a give-up
RECONNECT = 10.0  # seconds between new connections while some node does not answer
BEAT_EVERY = 5.0  # seconds between heartbeats (well inside supervision.STALE)
HUNG = 900.0  # seconds a loop may go without a step before its heartbeat stops: longer than
# any one step it takes (a relaunch's two 300 s waits, its stop and launch)

Connect = Callable[[Sequence[Host], float], AbstractContextManager[NodePool]]
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
    newest record, and how many nodes answered (``silent``: the nodes that did not). ``moved``:
    the record's membership is not the one asked (the supervisor now follows it, over a new
    connection)."""

    live: set[int]
    record: Supervision | None
    answered: int
    silent: list[Host] = field(default_factory=list)
    moved: bool = False


@dataclass(frozen=True)
class Refused:
    """Spares a change of membership could not use, each with why (down, sync, checks)."""

    spares: dict[Host, str]


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
    gone because the job was stopped, a ``gave up`` one that says so). ``hosts``, ``me`` and
    ``job`` follow the record's membership (a replacement may move ranks); ``cluster``: every
    node of the hostfile, spares included (empty: ``hosts``)."""

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
    cluster: Sequence[Host] = ()

    def __post_init__(self) -> None:
        self.node = self.hosts[self.me]  # this supervisor's node, whatever rank it holds
        self.launched = list(self.hosts)  # the membership before any record names one
        if not self.cluster:
            self.cluster = list(self.hosts)
        self.silence = Silence()  # since when each node has not answered
        self.opened = time.monotonic()  # when the pool being looked through was opened
        self.ignored: set[tuple[Host, int]] = set()  # copies far ahead, as the log named them

    def run(self) -> Supervision:
        while True:
            self.opened = time.monotonic()
            with self.connect(self.hosts, 0.0) as pool:
                outcome = self._serve(pool)
            if isinstance(outcome, Supervision):
                return outcome
            if outcome is None:
                continue  # a new connection at once: a node that went silent may be gone
            final = self._relaunch(outcome)
            if final is not None:
                return final
            time.sleep(self.interval)

    def _bound(self) -> float:
        """Seconds a node may go without answering before it is lost (--replace-after), or,
        with ``off``, before the relaunch gives up on it."""
        if self.job.replace_after is None:
            return COME_BACK
        return self.job.replace_after

    def _hear(self, pool: NodePool, answered: Collection[Host], asked: float) -> None:
        """Note in ``silence`` which nodes answered a poll sent at ``asked``: the others left it
        unanswered, or could not be connected to at all (since the pool's opening)."""
        for host in self.hosts:
            if host in answered:
                self.silence.heard(host)
            elif host in pool.failures:
                self.silence.unreachable(host, self.opened)
            else:
                self.silence.missed(host, asked)

    def _moved(self) -> None:
        """The loop took a step: its heartbeat goes on."""
        if self.heart is not None:
            self.heart.moved()

    def _look(self, pool: NodePool) -> Look:
        """Look at every node's supervisor, and follow the newest record's membership."""
        self._moved()
        asked = time.monotonic()
        answers = ask(pool, self.job, self.hosts, timeout=POLL_TIMEOUT)
        self._hear(pool, answers, asked)
        record = self._believed(answers)
        moved = self._follow(record)
        if moved:
            return Look({self.me}, record, len(answers), moved=True)
        live = live_ranks(self.hosts, answers)
        silent = [host for host in self.hosts if host not in answers]
        return Look(live | {self.me}, record, len(answers), silent)

    def _believed(self, answers: Answers) -> Supervision | None:
        """The nodes' copies as ``believed`` takes them against the generation this supervisor
        knows; a copy far ahead of it is named in the log (once)."""
        for host, reply in answers.items():
            copy = reply.record
            if copy is None or not far_ahead(copy, self.job.generation, len(self.cluster)):
                continue
            if (host, copy.generation) not in self.ignored:
                self.ignored.add((host, copy.generation))
                self.say(
                    f"{host.label}: its supervision record says generation "
                    f"{copy.generation}, more than {len(self.cluster)} past generation "
                    f"{self.job.generation}: ignored, not followed"
                )
        copies = [reply.record for reply in answers.values()]
        return believed(copies, self.job.generation, len(self.cluster))

    def _follow(self, record: Supervision | None) -> bool:
        """Take ``record``'s membership as this supervisor's (its nodes, this node's rank, the
        job's generation). Returns whether it changed."""
        if record is None or record.generation == self.job.generation:
            return False
        if record.generation < self.job.generation:
            return False  # an older copy (a node that was away): the newer membership stands
        try:
            members = members_of(record, self.launched, self.cluster)
        except JobError as exc:
            self.say(f"cannot follow generation {record.generation}: {exc}")
            return False
        self.hosts = members
        self.silence.forget(members)
        self.job = replace(
            self.job, members=tuple(host.label for host in members), generation=record.generation
        )
        if self.node in members:
            self.me = members.index(self.node)
            self.say(f"generation {record.generation}: this node is rank {self.me}")
        return True

    def _fence(self, pool: NodePool, record: Supervision) -> Supervision:
        """This node was lost and the job moved on without it (a newer generation): end what it
        still runs of the job here, keep the newer record here, and end; it is a spare now."""
        node = [self.node]
        self.say(
            f"generation {record.generation} does not include this node (it was lost and "
            "replaced): ending what it runs of the job here; it is a spare now"
        )
        with contextlib.suppress(MeshkitError), self.connect(node, RECONNECT) as own:
            ask(own, self.job, node, record=record, version=record.version)
            ending = StopRequest(self.job.id)
            own.call_all("stop", lambda host: ending, StopReply, node)
        return record

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
                time.sleep(self.interval)  # this node is cut off: a new connection in a while
                return None
            if record is None:  # every copy is gone (a train dropped them to start anew)
                why = "the supervision record is gone from every node"
                return Supervision(SupervisorState.GAVE_UP, 0, 0, why)
            if self.node not in self.hosts:
                return self._fence(pool, record)
            if look.moved:  # the new membership's nodes, over a new connection
                return None
            step = next_step(self.me, look.live, record)
            if step == Step.STOP:
                return self._carry_stop(pool, record)
            if step == Step.END:
                return record
            if step == Step.WATCH:
                record = self._note_wait(pool, record, look.silent)
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
            rows = ops.status(pool, self.job, self.hosts, phase="", timeout=POLL_TIMEOUT)
            refused = [rank for rank, host in enumerate(self.hosts) if host in self.silence.refused]
            seen = views(rows, misses, refused)
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
                    reason=restart_reason(seen, stalled),
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
        given = replace(
            record, supervisor=SupervisorState.GAVE_UP, last_restart_reason=why, waiting=None
        )
        return self._write(pool, given) or given

    @contextlib.contextmanager
    def _every_node(self, bound: float) -> Iterator[NodePool]:
        """A pool once every node answers (trying again every ``RECONNECT`` s), or, once those
        that do not have not answered for ``bound`` s (counted from the first poll each left
        unanswered, ``Silence``: the tries run inside the bound), the pool as it is. While it
        waits, the record says for which nodes and until when (status shows it)."""
        while True:
            self._moved()
            now = time.monotonic()
            deadline = self.silence.until(self.silence.silent(self.hosts), bound, now)
            # a try at a node that is off takes about RECONNECT (the connect timeout), so the
            # tries stop a try's length before the deadline instead of running past it
            wait = min(RECONNECT, max(0.0, deadline - now - RECONNECT))
            self.opened = now
            with self.connect(self.hosts, wait) as pool:
                for host in self.hosts:
                    if host in pool.failures:
                        self.silence.unreachable(host, now)
                    else:
                        self.silence.heard(host)
                missing = [host for host in self.hosts if host in pool.failures]
                if missing:
                    self._announce(pool, missing)
                deadline = self.silence.until(missing, bound, now)
                if not missing or time.monotonic() >= deadline:
                    yield pool
                    return

    def _announce(self, pool: NodePool, missing: list[Host]) -> None:
        """Say in the record which nodes the relaunch waits for, and until when."""
        record = self._look(pool).record
        if record is None or record.supervisor == SupervisorState.STOPPED:
            return
        self._note_wait(pool, record, missing)

    def _note_wait(self, pool: NodePool, record: Supervision, silent: list[Host]) -> Supervision:
        """While some nodes do not answer, the record says which, and until when the leader
        waits for them (then they are lost, or with ``off`` it gives up); once every node
        answers, nothing. Written on the nodes that answer (a silent one would hold the write
        up); returns the record as it is now."""
        waiting = None
        if silent:
            deadline = self.silence.until(silent, self._bound(), time.monotonic())
            until = time.time() + deadline - time.monotonic()
            stamp = datetime.datetime.fromtimestamp(until, datetime.timezone.utc)
            what = "lost then (--replace-after)"
            if self.job.replace_after is None:
                what = "given up then"
            names = [f"node {self.hosts.index(host)} ({host.label})" for host in silent]
            waiting = f"{', '.join(names)} until {stamp:%H:%M:%S} UTC, {what}"
        if waiting == record.waiting:
            return record
        if waiting is None:
            self.say("every node answers again")
        else:
            self.say(f"waiting for {waiting}")
        answering = [host for host in self.hosts if host not in silent]
        noted = write(pool, self.job, answering, replace(record, waiting=waiting), self.me)
        return noted or record

    def _lost(self) -> list[Host]:
        """The nodes that do not answer, when every one of them is lost already (silent for
        the bound, and a new connection failed too); else none."""
        silent = self.silence.silent(self.hosts)
        now = time.monotonic()
        bound = self._bound()
        if any(self.silence.state(host, now, bound) != Heard.LOST for host in silent):
            return []
        return silent

    def _back_off(self, attempt: int) -> None:
        """Wait before relaunch number ``attempt``, counted from the failure's first sign (a
        node's first unanswered poll, else now): the time spent noticing it counts."""
        now = time.monotonic()
        start = self.silence.first(self.hosts, now)
        left = start + backoff(attempt, self.base_backoff) - now
        if left > 0:
            time.sleep(left)

    def _relaunch(self, restart: Restart) -> Supervision | None:
        """Claim the next attempt (or take the claimed one over), and make it: every node
        answering, the job stopped everywhere, the health gate, the launch, then a supervisor
        on every node again. Returns the final record when it gives up; None when it is back to
        watching, or another supervisor moved on first."""
        job = self.job
        hosts = self.hosts
        say = self.say
        seen = restart.seen
        why = restart.claim.last_restart_reason
        if not restart.takeover:
            say(f"attempt {seen.attempt} failed: {why}")
            self._back_off(seen.attempt)
        lost = self._lost()
        if lost and job.replace_after is not None and not restart.takeover:
            # lost already (the bound ran while the failure was noticed): no wait, and no new
            # connection to them to wait its timeout out again
            return self._replace(replace(seen, last_restart_reason=why), lost)
        with self._every_node(self._bound()) as pool:
            look = self._look(pool)
            current = look.record
            if current is None or look.moved or not waited_only(seen, current):
                return None  # another supervisor moved on (only a "waiting" note is ours)
            if next_step(self.me, look.live, current) not in (Step.WATCH, Step.RESUME):
                return None
            claim = replace(restart.claim, version=current.version, waiting=None)
            if restart.takeover:
                claim = replace(current, waiting=None)
            missing = [host for host in hosts if host in pool.failures]
            if missing and job.replace_after is not None:
                return self._replace(replace(current, last_restart_reason=why), missing)
            if missing:
                names = ", ".join(host.label for host in missing)
                why = f"{why}; then {names} did not answer within {COME_BACK:.0f}s"
                codes = self._end_what_is_left(pool)
                return self._gave_up(pool, replace(current, exit_codes=codes), why)
            claimed = self._write(pool, claim, every=True)
            if claimed is None:
                say("another supervisor moved on first; following it")
                return None
            return self._finish(pool, claimed)

    def _replace(self, seen: Supervision, lost: list[Host]) -> Supervision | None:
        """``lost`` did not answer within --replace-after: a new membership without them (their
        ranks to healthy spares, or the job shrunk with --min-nodes), claimed on every node of
        it and launched. With neither possible, wait up to --replace-after more for the nodes or
        a spare, then give up saying so."""
        job = self.job
        bound = self._bound()
        names = ", ".join(host.label for host in lost)
        self.say(f"lost: {names} (no answer within {bound:.0f}s, --replace-after)")
        deadline = time.monotonic() + bound
        refused: dict[Host, str] = {}
        while True:
            self._moved()
            candidates = [
                host for host in spares_of(self.cluster, self.hosts) if host not in refused
            ]
            change = plan(self.hosts, lost, candidates, self.cluster, job.min_nodes)
            if change is not None:
                outcome = self._try_change(seen, change)
                if isinstance(outcome, Refused):
                    for spare, why in outcome.spares.items():
                        self.say(f"spare {spare.label} not used: {why}")
                    refused.update(outcome.spares)
                    continue
                return outcome
            if time.monotonic() > deadline:
                why = f"{seen.last_restart_reason}; then {names} did not answer within "
                why += f"{bound:.0f}s (--replace-after) and no healthy spare took its place"
                if refused:
                    spares = "; ".join(f"{host.label}: {text}" for host, text in refused.items())
                    why += f" (spares: {spares})"
                elif not spares_of(self.cluster, self.hosts):
                    why += " (the hostfile has no spare line)"
                if job.min_nodes is not None:
                    why += f", and fewer than --min-nodes {job.min_nodes} nodes are left"
                with self.connect(self.hosts, 0.0) as pool:
                    codes = self._end_what_is_left(pool)
                    return self._gave_up(pool, replace(seen, exit_codes=codes), why)
            with self.connect(self.hosts, RECONNECT) as pool:
                if not pool.failures:
                    self.say("every node answers again; back to watching")
                    return None
            refused.clear()  # a spare refused a while ago may be healthy now
            time.sleep(self.interval)

    def _end_what_is_left(self, pool: NodePool) -> list[int | None]:
        """The job cannot go on without its lost nodes: end it on the nodes that answer (its
        ranks wait on their lost peers), keeping the codes they end with; each node's code."""
        job = self.job
        left = [host for host in self.hosts if host not in pool.failures]
        ending = StopRequest(job.id, keep_exit=True)
        pool.call_all("stop", lambda host: ending, StopReply, left)
        return [row.exit_code for row in ops.status(pool, job, self.hosts, phase="")]

    def _try_change(self, seen: Supervision, change: Change) -> Supervision | Refused | None:
        """Make ``change`` over the nodes of the new membership: each spare taking a rank must
        answer, get the workdir (a synced job) and pass the doctor's quick checks; then the new
        generation is claimed on every node of it and launched. ``Refused``: spares it could not
        use; None: back to watching (another supervisor moved on, or a member is down too)."""
        labels = tuple(host.label for host in change.members)
        job = replace(self.job, members=labels, generation=seen.generation + 1)
        with self.connect(change.members, RECONNECT) as pool:
            down = {host: pool.failures[host] for host in change.added if host in pool.failures}
            if down:
                return Refused(down)
            if any(host in pool.failures for host in change.members):
                return None
            if job.sync:
                from .sync import sync_workdir

                try:
                    sync_workdir(pool, job, change.added)
                except (LaunchError, RemoteError) as exc:
                    why = str(exc).replace("\n", "; ")
                    return Refused({host: f"sync failed: {why}" for host in change.added})
            for where in job.home_copies(change.members):
                pool.write_file(where, job.node_hostfile, members_text(change.members))
            held = self.gate(pool, job, change.members)
            unfit = {}
            for spare in change.added:
                said = [line for line in held if line.startswith(f"{spare.label}:")]
                if said:
                    unfit[spare] = said[0]
            if unfit:
                return Refused(unfit)
            claim = replace(
                seen,
                supervisor=SupervisorState.RELAUNCHING,
                attempt=seen.attempt + 1,
                reason=change.reason,
                generation=job.generation,
                members=list(labels),
                lost=[*seen.lost, *(host.label for host in change.lost)],
                replaced=[*seen.replaced, *change.replaced],
                last_restart_reason=reason_of_change(change),
                waiting=None,
                held=None,
            )
            rank = change.members.index(self.node)
            claimed = write(pool, job, change.members, claim, rank, every=True)
            if claimed is None:
                self.say("another supervisor moved on first; following it")
                return None
            self.say(f"generation {claimed.generation}: {claimed.last_restart_reason}")
            self._follow(claimed)
            # the checks just passed on every node of it: not run again before the launch
            return self._finish(pool, claimed, checked=not held)

    def _finish(
        self, pool: NodePool, claimed: Supervision, checked: bool = False
    ) -> Supervision | None:
        """Make the claimed attempt: stop the job everywhere, hold while the health gate fails
        (``checked``: it passed on every node just before the claim), launch, then a supervisor
        on every node again."""
        job = self.job
        hosts = self.hosts
        say = self.say
        attempt = claimed.attempt
        last = attempt + claimed.restarts_left
        say(f"attempt {attempt}: relaunching (of {last}); stopping the job")
        ops.stop(pool, job, hosts)
        deadline = time.monotonic() + COME_BACK
        while not checked:
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
        failure = self._launch(pool, claimed)
        if failure is not None:  # a failed attempt: the next poll sees the nodes absent
            say(f"attempt {attempt} did not start: {failure}")
        running = replace(claimed, supervisor=SupervisorState.RUNNING, held=None)
        if self._write(pool, running) is None:
            return None
        say(f"attempt {attempt} started")
        start_all(pool, job, hosts)  # where none is live: a rebooted node's comes back
        return None

    def _launch(self, pool: NodePool, claimed: Supervision) -> str | None:
        """Launch the claimed attempt on every node; why it did not start (None: it did)."""
        attempt = claimed.attempt
        try:
            if self.relaunch is not None:
                launched = self.relaunch(pool, self.job, attempt)
            else:
                launched = ops.launch(
                    pool,
                    self.job,
                    self.hosts,
                    attempt=attempt,
                    reason=str(claimed.reason),
                    replacement="; ".join(claimed.replaced),
                    last=attempt + claimed.restarts_left,
                )
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
    connect: Connect,
    job: Job,
    hosts: Sequence[Host],
    rank: int,
    say: Callable[[str], None],
    cluster: Sequence[Host] = (),
) -> Supervision:
    """``meshkit supervise`` (what ``train --restarts`` starts in tmux on every node): register
    here, with a heartbeat in its pid file, then follow or lead until the job ends. ``cluster``:
    every node of the hostfile, spares included."""
    if not 0 <= rank < len(hosts):
        raise UsageError(f"--rank {rank}: the job has ranks 0..{len(hosts) - 1}")
    with Heartbeat(job.id).beating() as heart:
        say(f"supervising {job.label} from node {rank}, restarts {job.restarts}")
        supervisor = Supervisor(connect, job, hosts, rank, say, heart=heart, cluster=cluster)
        record = supervisor.run()
    say(f"ending: the job's supervision is {record.supervisor}")
    return record
