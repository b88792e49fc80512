"""Supervised jobs (``train --restarts N``): a supervisor on every node of the job, the lowest-
ranked live one leading, so the reboot of any one node (the launching one and the master
included) leaves the job supervised. The leader watches every node and acts on what each poll
asks for (``supervision_policy.Action``, whose docstring is the state machine): it waits, ends
DONE, gives up, restarts (waits for every node to answer, claims the next attempt in the record
by compare-and-set on every node, so that two supervisors never relaunch at once, stops the job,
waits while the doctor's quick checks fail, and relaunches it with the same ranks, at most N
times), replaces lost nodes (``ops.replacement``: a new generation of the membership,
``ops.membership``, that every supervisor then follows and that fences the lost node should it
come back), or finishes a claimed attempt whose claimer is gone. This module is the loop
(``Supervisor``, ``run``), one method per action; its policy is ``ops.supervision_policy``, its
rounds over the nodes ``ops.supervision``. It prints nothing: it reports through ``say``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from ..errors import JobError, UsageError
from ..events import Blame, EventKind
from ..health import HealthState
from ..hostfile import Host
from ..job import Job
from ..node.supervise import Heartbeat
from ..protocol import JobState, StopReply, StopRequest, Supervision, SupervisorState
from ..quorum import majority, past_unproven
from ..record import replace
from . import jobs as ops
from .diagnose import save_diagnosis
from .event_log import History
from .eviction import evict_nodes, health_changes, judge
from .fencing import alone, carry_stop, fence, superseded
from .membership import can_change, members_of
from .pace import Pace, watch_pace
from .pool import NodePool
from .relaunch import COME_BACK, Connect, Gate, Launcher, finish, health
from .replacement import RECONNECT, end_what_is_left, replace_lost, waiting_note
from .stall import stall, stalled_at
from .supervision import ask, view, write
from .supervision_policy import (
    BACKOFF,
    Action,
    Call,
    Cause,
    Decision,
    Final,
    Look,
    Majority,
    NodeView,
    Outcome,
    Silence,
    Step,
    Then,
    backoff,
    decide,
    next_step,
    views,
    waited_only,
)

POLL_INTERVAL = 2.0  # seconds between polls of every node
POLL_TIMEOUT = 15.0  # seconds a node gets to answer a poll: a powered-off node's connection
# does not fail, it goes silent, and the command timeout would hide the loss for minutes (the
# bound a node is lost after counts from the poll's start: ``Silence``)
FOLLOWER_POLLS = 3  # a follower polls every 3rd interval: all at every one is N² requests
GIVE_UP_GRACE = 30.0  # seconds the nodes still running get to end by themselves after a give-up


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
        self.silence = Silence()  # the one tracker of the nodes that do not answer
        self.opened = time.monotonic()  # when the pool being looked through was opened
        self.ignored: set[int] = set()  # generations no majority carries, as the log named them
        self.majority = Majority(time.monotonic())  # whether this side has a majority
        self.unanswered: list[Host] = []  # the nodes the last look heard nothing from
        self.above = 0  # the highest generation a node claims and no majority carries
        self.history = History(self.job, self.say)  # the job's events, written at each look
        self.healths: dict[str, HealthState] = {}  # each node's health as last polled
        self.pace = Pace()  # what the polls saw of the ranks' steps

    def run(self) -> Supervision:
        """Watch, act on what a watch calls for, and again, until an action ends it all."""
        while True:
            outcome = self._round()
            if isinstance(outcome, Final):
                with self.connect(self.nodes(), 0.0) as pool:
                    self.history.flush(pool, self.job, self.nodes())
                self.history.close()
                return outcome.record
            if outcome == Then.WATCH:
                time.sleep(self.interval)

    def _round(self) -> Outcome:
        """One connection: watch until there is something to do, then do it, on that
        connection when it ends the job (DONE, GIVE_UP), else once it is closed (a relaunch
        opens its own, to the nodes it waits for)."""
        ending = {Action.DONE: self._done, Action.GIVE_UP: self._give_up}
        relaunching = {
            Action.RESTART: self._restart,
            Action.REPLACE: self._replace,
            Action.EVICT: self._evict,
            Action.RESUME: self._resume,
        }
        self.opened = time.monotonic()
        with self.connect(self.nodes(), 0.0) as pool:
            watched = self._watch(pool)
            if isinstance(watched, Call) and watched.decision.action in ending:
                return ending[watched.decision.action](pool, watched)
        if isinstance(watched, Call):
            return relaunching[watched.decision.action](watched)
        return watched

    def _watch(self, pool: NodePool) -> Call | Outcome:
        """Follow or lead on this pool until a poll calls for an action (never WAIT), the
        supervision ends, or a new connection is due (a node that did not answer may be back)."""
        started: dict[int, float] = {}
        attempt = 0
        since = time.monotonic()
        self.silence.recount()
        while True:
            look = self._look(pool)
            record = look.record
            if look.newer:
                return Final(superseded(self, pool))
            if not look.settled:  # only where the membership can change: ``quorum``
                alone(self, self.majority, len(self.nodes()))
                if time.monotonic() - since > RECONNECT:
                    return Then.RECONNECT  # the nodes it misses may answer a new connection
                time.sleep(self.interval)
                continue
            if not look.answered:
                return Then.WATCH  # this node is cut off: a new connection in a while
            if record is None:  # every copy is gone (a train dropped them to start anew)
                why = "the supervision record is gone from every node"
                return Final(Supervision(SupervisorState.GAVE_UP, 0, 0, why))
            if self.node not in self.hosts:
                return Final(fence(self, record))
            if look.moved:  # the new membership's nodes, over a new connection
                return Then.RECONNECT
            step = next_step(self.me, look.live, record)
            if step == Step.STOP:
                return Final(carry_stop(self, pool, record))
            if step == Step.END:
                return Final(record)
            if step == Step.WATCH:
                record = self._note_wait(pool, record, look.silent)
            # a node that did not answer (never connected, or its channel died with a reboot)
            # may be back by now: look through a new connection
            late = time.monotonic() - since > RECONNECT
            if look.silent and late:
                return Then.RECONNECT
            if step == Step.RESUME:
                return Call(Decision(Action.RESUME), record, record)
            if step == Step.FOLLOW:
                started.clear()
                self.silence.recount()
                time.sleep(self.interval * FOLLOWER_POLLS)
                continue
            if record.attempt != attempt:
                started.clear()
                attempt = record.attempt
            call = self._poll(pool, record, started)
            if call.decision.action != Action.WAIT:
                return call
            time.sleep(self.interval)

    def _poll(self, pool: NodePool, record: Supervision, started: dict[int, float]) -> Call:
        """One poll of the job on every node, and the policy's decision on it. A stall's
        diagnosis is saved before anything is stopped, and named in the decision's reason."""
        job = self.job
        rows = ops.status(pool, job, self.hosts, phase="", timeout=POLL_TIMEOUT, health=True)
        health_changes(self, self.healths, rows)
        seen = views(rows, self.hosts, self.silence)
        for node in seen:
            if node.started is not None:
                started.setdefault(node.rank, node.started)
        stalled = None
        found = stall(job, ops.watched(rows))
        if job.restart_on_stall and found is not None:
            stalled = f"the job stalled: {found.words}"
        replaceable = job.replace_after is not None
        left = record.restarts_left
        decision = decide(seen, started, job.restart_on, left, stalled, replaceable)
        codes = [node.exit_code for node in seen]
        diagnosis = record.diagnosis
        if decision.cause == Cause.STALL:
            saved = save_diagnosis(pool, job, self.hosts, record.attempt)
            diagnosis = saved.path
            reason = f"{decision.reason}; outliers: {saved.outliers} (diagnosis: {saved.path})"
            decision = replace(decision, reason=reason)
            self.say(f"saved the diagnosis: {saved.path}")
            self.tell(EventKind.STALLED, reason, *stalled_at(found, saved.nodes, self.hosts))
        kept = replace(record, exit_codes=codes, diagnosis=diagnosis)
        self.pace.see(record.attempt, rows)
        call = Call(decision, record, kept, seen)
        judged = judge(self, pool, call, rows, started, self.pace.made_step())
        return watch_pace(self, pool, self.pace, judged, rows)

    # ---- the actions: DONE and GIVE_UP on the watch's connection, the relaunches after it

    def _done(self, pool: NodePool, call: Call) -> Outcome:
        """DONE: every node exited 0. Should another supervisor have written first, watch
        again (over a new connection)."""
        final = self._write(pool, replace(call.kept, supervisor=SupervisorState.DONE))
        if final is None:
            return Then.RECONNECT
        self.say("done: every node exited 0")
        self.tell(EventKind.DONE, f"done: every node exited 0 (attempt {final.attempt})")
        return Final(final)

    def _give_up(self, pool: NodePool, call: Call) -> Outcome:
        """GIVE_UP: a fatal code, or a failure with no restart left."""
        return self._end_and_give_up(pool, call.kept, call.nodes, call.decision.reason)

    def _restart(self, call: Call) -> Outcome:
        """RESTART: a failure, a stall or a reboot: the next attempt, once every node
        answers."""
        claim = replace(
            call.kept,
            supervisor=SupervisorState.RELAUNCHING,
            last_restart_reason=call.decision.reason,
            attempt=call.record.attempt + 1,
            restarts_left=call.record.restarts_left - 1,
            reason=call.decision.told,
        )
        left = call.record.restarts_left - 1
        self.tell(EventKind.RESTARTED, f"restarting ({left} left): {call.decision.reason}")
        return self._relaunch(call, claim)

    def _evict(self, call: Call) -> Outcome:
        """EVICT: members put out of the job (``ops.eviction``); no restart used."""
        return evict_nodes(self, call)

    def _replace(self, call: Call) -> Outcome:
        """REPLACE: nodes that do not answer. Once lost (``Silence``), their ranks go to
        spares (``ops.replacement``), which uses up no restart; should every node answer again
        first, the failure is a restart, which needs one left."""
        if call.record.restarts_left <= 0:
            return self._relaunch(call, None)
        return self._restart(call)

    def _resume(self, call: Call) -> Outcome:
        """RESUME: the claimed attempt of a supervisor that is gone, finished by the leader:
        the same attempt, never a new one."""
        seen = call.record
        return self._claim(seen, seen.last_restart_reason or "", None, takeover=True)

    def _relaunch(self, call: Call, claim: Supervision | None) -> Outcome:
        """Back off, then claim the next attempt (``claim``; None: none is left) and make it.
        Nodes lost meanwhile (the bound ran while the failure was noticed) are replaced at
        once: no wait, and no new connection to them to wait its timeout out again."""
        seen = call.record
        why = call.decision.reason
        self.say(f"attempt {seen.attempt} failed: {why}")
        self._back_off(seen.attempt)
        lost = self._lost()
        if lost and self.job.replace_after is not None:
            return replace_lost(self, replace(seen, last_restart_reason=why), lost, self._bound())
        return self._claim(seen, why, claim, takeover=False)

    def _claim(
        self,
        seen: Supervision,
        why: str,
        claim: Supervision | None,
        takeover: bool,
    ) -> Outcome:
        """Wait for every node to answer (those that do not: lost, to the replacement, or the
        job given up); then write the claim over the record (``takeover``: the claimed one as
        it is) by compare-and-set on every node, and make the attempt. Back to watching when
        another supervisor moved on first (only a "waiting" note is ours)."""
        with self._every_node(self._bound()) as pool:
            look = self._look(pool)
            current = look.record
            if not look.settled or look.newer:
                return Then.WATCH  # no majority on this side: the watch says so, and waits
            if current is None or look.moved or not waited_only(seen, current):
                return Then.WATCH
            if next_step(self.me, look.live, current) not in (Step.WATCH, Step.RESUME):
                return Then.WATCH
            missing = [host for host in self.hosts if host in pool.failures]
            if missing and self.job.replace_after is not None:
                noted = replace(current, last_restart_reason=why)
                return replace_lost(self, noted, missing, self._bound())
            if missing:
                names = ", ".join(host.label for host in missing)
                why = f"{why}; then {names} did not answer within {COME_BACK:.0f}s"
                codes = end_what_is_left(pool, self.job, self.hosts)
                return self.gave_up(pool, replace(current, exit_codes=codes), why)
            if takeover:
                claim = replace(current, waiting=None)
            elif claim is None:  # they answer again, and no restart is left to relaunch them
                given = f"no restarts left; last failure: {why}"
                # a fresh poll: the node that came back may run its part of the job still
                rows = ops.status(pool, self.job, self.hosts, phase="", timeout=POLL_TIMEOUT)
                now = views(rows, self.hosts, self.silence)
                return self._end_and_give_up(pool, current, now, given)
            else:
                claim = replace(claim, version=current.version, waiting=None)
                if self.above:  # past claims no majority took: no node refuses this one
                    claim = replace(claim, generation=self.above + 1)
            claimed = self._write(pool, claim, every=True)
            if claimed is None:
                self.say("another supervisor moved on first; following it")
                return Then.WATCH
            self.follow(claimed)  # a generation past unproven claims: its launch says so
            return finish(self, pool, claimed)

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

    def tell(
        self,
        kind: EventKind,
        text: str,
        node: str | None = None,
        rank: int | None = None,
        blame: Blame | None = None,
        attempt: int | None = None,
    ) -> None:
        """Record an event: written on every node at the next look, and --notify told."""
        by = f"supervisor of node {self.me} ({self.node.label})"
        self.history.add(self.job, kind, text, node, rank, blame, by, attempt)

    def moved(self) -> None:
        """The loop took a step: its heartbeat goes on."""
        if self.heart is not None:
            self.heart.moved()

    @property
    def quorum(self) -> list[Host]:
        """The nodes a majority is counted over: every node of the job, where its membership
        can change (``can_change``); else none, and the supervisor acts as one that needs every
        member does."""
        if not can_change(self.job, self.hosts, self.cluster):
            return []
        return self.nodes()

    def nodes(self) -> list[Host]:
        """The nodes this supervisor connects to: the members in rank order, then the rest of
        the hostfile (spares, lost nodes), whose copies count towards a majority."""
        return [*self.hosts, *(host for host in self.cluster if host not in self.hosts)]

    def _look(self, pool: NodePool) -> Look:
        """Look at the supervisor and the record copy of every node of the job (spares
        included), and follow the membership believed (``quorum.believe``)."""
        self.moved()
        asked = time.monotonic()
        members = [host for host in self.nodes() if host in self.hosts]
        answers = ask(pool, self.job, self.nodes(), timeout=POLL_TIMEOUT)
        self.history.flush(pool, self.job, [host for host in self.nodes() if host in answers])
        seen = view(answers, self.hosts, self.job, len(self.nodes()))
        if seen.record is not None:
            self.history.attempt = seen.record.attempt
        if self.majority.looked(seen.belief.quorum, time.monotonic()):
            self.silence.restart()  # a majority again: silence counts from now (``Majority``)
        self._hear(pool, answers, asked)
        self._name_unproven(seen.belief.unproven)
        silent = [host for host in members if host not in answers]
        self.unanswered = [host for host in self.nodes() if host not in answers]
        self.above = past_unproven(seen.belief)
        settled = seen.belief.settled or not self.quorum
        if seen.belief.newer or not settled:
            live = set(seen.live) | {self.me}
            return Look(
                live,
                seen.record,
                len(answers),
                silent,
                settled=settled,
                newer=seen.belief.newer,
            )
        moved = self.follow(seen.record)
        if moved:
            return Look({self.me}, seen.record, len(answers), moved=True)
        return Look(set(seen.live) | {self.me}, seen.record, len(answers), silent)

    def _name_unproven(self, generations: Sequence[int]) -> None:
        """Name in the log (once) each generation some node claims and no majority carries:
        ``view`` believes none of them (a claim that failed, a damaged copy, a bad node)."""
        for generation in generations:
            if generation not in self.ignored:
                self.ignored.add(generation)
                self.say(
                    f"generation {generation} is claimed by fewer than a majority of the job's "
                    f"{len(self.nodes())} nodes: not followed"
                )

    def follow(self, record: Supervision | None) -> bool:
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

    def _write(
        self, pool: NodePool, record: Supervision, every: bool = False
    ) -> Supervision | None:
        return write(
            pool, self.job, self.hosts, record, self.me, every, self.quorum, self.unanswered
        )

    def _end_and_give_up(
        self, pool: NodePool, record: Supervision, seen: list[NodeView], why: str
    ) -> Final:
        """Give up, the nodes still running ended first. The other nodes usually fail on their
        own within seconds (torchrun notices a lost peer): they get a while, so status shows
        the codes they really ended with."""
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
        return self.gave_up(pool, replace(record, exit_codes=codes), why)

    def gave_up(self, pool: NodePool, record: Supervision, why: str) -> Final:
        """Write GAVE UP, saying ``why``: the supervision is over."""
        self.say(f"gave up: {why}")
        self.tell(EventKind.GAVE_UP, f"gave up: {why}")
        given = replace(
            record, supervisor=SupervisorState.GAVE_UP, last_restart_reason=why, waiting=None
        )
        return Final(self._write(pool, given) or given)

    @contextlib.contextmanager
    def _every_node(self, bound: float) -> Iterator[NodePool]:
        """A pool once every node answers (trying again every ``RECONNECT`` s), or, once those
        that do not have not answered for ``bound`` s (counted from the first poll each left
        unanswered, ``Silence``: the tries run inside the bound), the pool as it is. While it
        waits, the record says for which nodes and until when (status shows it)."""
        while True:
            self.moved()
            now = time.monotonic()
            deadline = self.silence.until(self.silence.silent(self.hosts), bound, now)
            # a try at a node that is off takes about RECONNECT (the connect timeout), so the
            # tries stop a try's length before the deadline instead of running past it
            wait = min(RECONNECT, max(0.0, deadline - now - RECONNECT))
            self.opened = now
            with self.connect(self.nodes(), wait) as pool:
                for host in self.hosts:
                    if host in pool.failures:
                        self.silence.unreachable(host, now)
                    else:
                        self.silence.heard(host)
                missing = [host for host in self.hosts if host in pool.failures]
                answering = [host for host in self.nodes() if host not in pool.failures]
                if self.quorum and len(answering) < majority(len(self.nodes())):
                    yield pool  # no majority on this side: nothing to wait for here
                    return
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
            names = [f"node {self.hosts.index(host)} ({host.label})" for host in silent]
            waiting = waiting_note(names, until, self.job.replace_after)
        if waiting == record.waiting:
            return record
        if waiting is None:
            self.say("every node answers again")
        else:
            self.say(f"waiting for {waiting}")
        answering = [host for host in self.hosts if host not in silent]
        noted = write(
            pool,
            self.job,
            answering,
            replace(record, waiting=waiting),
            self.me,
            False,
            self.quorum,
            self.unanswered,
        )
        return noted or record

    def _lost(self) -> list[Host]:
        """The nodes that do not answer, when every one of them is lost already (silent for
        the bound, and a new connection failed too); else none."""
        return self.silence.lost(self.hosts, time.monotonic(), self._bound())

    def _back_off(self, attempt: int) -> None:
        """Wait before relaunch number ``attempt``, counted from the failure's first sign (a
        node's first unanswered poll, else now): the time spent noticing it counts."""
        now = time.monotonic()
        start = self.silence.first(self.hosts, now)
        left = start + backoff(attempt, self.base_backoff) - now
        if left > 0:
            time.sleep(left)


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
