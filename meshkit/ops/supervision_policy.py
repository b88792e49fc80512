"""The supervisor's policy, pure: how one poll's status rows look to it (``views``), what to do
about them (``decide``: an ``Action`` and its ``Cause``), how long to wait before a relaunch
(``backoff``), and what each supervisor does next (``next_step``). The state machine is written
once, in ``Action``'s docstring; how a node that stops answering becomes lost, in ``Silence``'s.
The loop around it is ``ops.supervise``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from ..health import HealthState, NodeHealth, at_least
from ..hostfile import Host
from ..protocol import JobState, RestartReason, Supervision, SupervisorState
from ..record import StrEnum, replace
from .jobs import StatusRow
from .supervision import leader
from .verdicts import Check

MISSES = 2  # consecutive unanswered polls before a node counts as gone (one blip is no failure)
BACKOFF = 2.0  # seconds before the first relaunch, doubled for each later one
MAX_BACKOFF = 60.0


class Action(StrEnum):
    """What the leader does after one poll (``decide``), or, for ``RESUME``, after one look at
    the record (``next_step``). The loop (``ops.supervise``) has one method per action.

    The supervision's states (``protocol.SupervisorState``), one record per job with a copy on
    every node, written by compare-and-set (``ops.supervision``), and the actions that move
    them::

                   RESTART: claim the next attempt                   launched
                   (every node answering)
          RUNNING  --------------------------------> RELAUNCHING  ---------> RUNNING
             |     REPLACE: claim generation + 1          |                  (attempt + 1)
             |     (a spare takes each lost rank,         |
             |      or the job shrinks)                   +-- RESUME: the leader finishes
             |     EVICT: claim generation + 1            |   a gone claimer's attempt
             |     (an unhealthy node or a lemon out,     |
             |      a spare takes its rank, or shrink)    |
             +-- DONE: every node exited 0 --> DONE       |
             +-- GIVE_UP: a fatal code, or no restart     +-- nodes gone, or held past
                 left for a failure --> GAVE UP               300 s --> GAVE UP

          any state  ---- meshkit stop ---->  STOPPED

    1. ``RUNNING``: the attempt runs; the leader, the lowest live rank, watches it (``decide``):
       ``WAIT``; ``DONE``; ``GIVE_UP``; ``RESTART`` (a failure, stall or reboot: back off, wait
       for every node, claim the next attempt, stop, hold while the health gate fails, launch,
       at most ``--restarts`` times); ``REPLACE`` (nodes that do not answer, with
       ``--replace-after``, whatever the other nodes did meanwhile: once lost, their ranks go
       to healthy spares, or the job shrinks with ``--min-nodes``, in a new ``generation``
       (``ops.membership``, ``ops.replacement``); a replacement uses up no restart, so it is
       decided whatever ``restarts_left`` is; nodes that answer again before they are lost
       are a restart, which needs one left); ``EVICT`` (a member whose health is unhealthy, or
       degraded with --evict degraded, or a lemon: --evict-after failures attributed to it,
       ``ops.attribution``): the job ended, the node kept out of the job (``evicted``), its
       rank to a healthy spare or the job shrunk with --min-nodes, in a new generation
       (``ops.eviction``); no restart is used. With neither, the node is noted ``unhealthy``
       in the record and the job goes on (or restarts) on it. A crash loop ends: failed
       starts in a row (``crashed``) give up, "restarting is not helping".
    2. ``RELAUNCHING``: rank ``by`` claimed the next attempt and makes it; if it is gone, the
       leader finishes the same attempt (``RESUME``), never a new one.
    3. ``DONE``, ``GAVE UP``: final; every supervisor ends (``Step.END``).
    4. ``STOPPED``: final, and it wins over every other record of its launch whatever the
       versions (``quorum.keeps``, ``quorum.believe``: a node replaces it with nothing but
       another stop), so a
       supervisor that ``stop`` could not reach (a partition) and that counted versions on its
       own side still finds it once it reconnects. It relaunches nothing: a stop ends the whole
       job, so it ends the job on the nodes whose copy does not say stopped yet (the ones the
       stop did not reach), leaves the record there, and ends (``Step.STOP``).
    5. Every supervisor follows the newest generation a majority of the job's nodes carries;
       one whose node is in none is fenced: it ends what its node runs of the job, and its
       node is a spare from then on (``ops.fencing``).
    """

    WAIT = "wait"
    RESTART = "restart"
    REPLACE = "replace"
    EVICT = "evict"
    RESUME = "resume"
    DONE = "done"
    GIVE_UP = "gave up"


class Cause(StrEnum):
    """Why a decision was taken: a node that exited with a failing code or whose job was
    restarted outside the supervisor (FAILURE), the job's stall (STALL, --restart-on-stall: its
    diagnosis is saved first), a job gone from a node (REBOOT), or nodes that do not answer
    (LOST: lost once ``Silence`` says so), a member's health (HEALTH), the failures counted
    against it (LEMON) or its pace (STRAGGLER, --evict-stragglers), which evict it."""

    FAILURE = "failure"
    STALL = "stall"
    REBOOT = "reboot"
    LOST = "lost"
    HEALTH = "health"  # a member's health evicts it
    LEMON = "lemon"  # --evict-after failures attributed to one node
    STRAGGLER = "straggler"  # --evict-stragglers: a node slower than the others per step


@dataclass(frozen=True)
class Decision:
    """One ``Action`` and why: its ``cause`` (None: nothing went wrong, WAIT and DONE), the
    ``reason`` the record and the log say, and ``told``, what every rank of a relaunch is told
    (``MESHKIT_RESTART_REASON``)."""

    action: Action
    cause: Cause | None = None
    reason: str = ""
    told: RestartReason = RestartReason.FAILURE


class Then(StrEnum):
    """What the loop does once an action is made and the supervision goes on: WATCH again
    over a new connection after one interval, or RECONNECT at once (a node that did not answer
    may be back, or the membership moved)."""

    WATCH = "watch"
    RECONNECT = "reconnect"


@dataclass(frozen=True)
class Final:
    """The supervision is over: this supervisor ends with ``record``."""

    record: Supervision


Outcome = Union[Then, Final]  # what an action leads to (typing's Union: Python 3.9 nodes)


def held_by(check: Check) -> str:
    """A failed health check as the record's ``held`` and the log say it: "NODE: CHECK:
    DETAIL"."""
    return f"{check.node}: {check.check}: {check.detail}"


class Step(StrEnum):
    """What a supervisor does next: END (the supervision is over), STOP (the job was stopped:
    carry the stop to the nodes it did not reach, then end), FOLLOW another one, WATCH the job
    as the leader, or RESUME a claimed relaunch."""

    END = "end"
    STOP = "stop"
    FOLLOW = "follow"
    WATCH = "watch"
    RESUME = "resume"


class Heard(StrEnum):
    """A node's state in ``Silence``."""

    ANSWERS = "answers"
    SILENT = "silent"
    UNREACHABLE = "unreachable"
    LOST = "lost"


@dataclass(frozen=True)
class NodeView:
    """One node as the supervisor sees it in one poll: a job's state, or UNREACHABLE when it
    counts as not answering (``Silence.gone``)."""

    rank: int
    host: str
    state: JobState | Heard
    exit_code: int | None = None
    started: float | None = None


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
    settled: bool = True  # a majority of the job's nodes answered and carries ``record``
    newer: bool = False  # some node holds a later launch's copy: this job was started anew


@dataclass(frozen=True)
class Call:
    """A poll's decision to act on: the ``record`` as the nodes held it, ``kept``, the record
    with the poll's exit codes and diagnosis (what a claim, DONE or GAVE UP writes over it),
    and the poll's ``nodes``."""

    decision: Decision
    record: Supervision
    kept: Supervision
    nodes: list[NodeView] = field(default_factory=list)
    evict: dict[str, str] = field(default_factory=dict)  # EVICT's nodes (as the hostfile spells
    # them), each with why


@dataclass
class Majority:
    """Whether this supervisor's node is on the side of a partition that has a majority of the
    job's nodes, and when it last was (monotonic times the caller gives; pure). A side without
    a majority acts on nothing; should the job's membership be able to change, the other side
    gives this node's rank away once --replace-after passes from the first silence, so past half
    of it this node ends its part of the job (``fence_now``), once per time it is cut off: two
    memberships never run at once."""

    seen_at: float
    fenced: bool = False

    seen_now: bool = True  # the last look found a majority

    def looked(self, quorum: bool, now: float) -> bool:
        """A look found a majority of the job's nodes answering (``quorum``), or not. Returns
        whether it found one again after looks that did not: then the silence of the nodes it
        misses counts anew (``Silence.restart``). A node silent to this side while this side
        had no majority may have had a majority of its own; it knows itself cut off only once
        this side has one, and ends its part half of --replace-after after that: counted from
        then, --replace-after passes only after it did."""
        regained = quorum and not self.seen_now
        self.seen_now = quorum
        if quorum:
            self.seen_at = now
            self.fenced = False  # cut off again later: fenced again
        return regained

    def fence_now(self, now: float, bound: float | None, changes: bool) -> bool:
        """Whether to end this node's part now: without a majority for half of ``bound``
        (--replace-after; None: off, no membership ever changes), when the membership can
        change (``changes``: spares, or --min-nodes), and not done since the majority was
        lost."""
        if self.fenced or bound is None or not changes:
            return False
        if now - self.seen_at < bound / 2:
            return False
        self.fenced = True
        return True


@dataclass
class Silence:
    """The one tracker of the nodes that do not answer: since when each has not (the start of
    the first poll it left unanswered), which of them a new connection could not reach either,
    and how many status polls in a row each left unanswered. Over monotonic times the caller
    gives (pure).

    How a node that stops answering becomes lost (``state``)::

                     a poll unanswered              a new connection fails too
          ANSWERS  ---------------------> SILENT  -----------------------------> UNREACHABLE
             ^      (since: that poll's start)                                      |
             +------------- it answers a poll, or a new connection reaches it ------+
                                                                                    |
                                                       since + --replace-after      v
                                                     ------------------------->   LOST

    The bound counts from the first poll the node left unanswered, the moment it stopped
    answering, not from when the leader noticed: a poll waits its own bound before it counts
    as unanswered, and a new connection its connect timeout, and both run inside
    ``--replace-after`` instead of before it. A node is lost only once a new connection failed
    as well (a wedged channel to a live node is not a lost node).

    Before that, a poll's view takes a node as gone (``gone``: a failure to act on) once it
    left ``MISSES`` status polls in a row unanswered (one blip is no failure), or at once when
    a new connection could not reach it."""

    since: dict[Host, float] = field(default_factory=dict)
    refused: set[Host] = field(default_factory=set)
    misses: dict[Host, int] = field(default_factory=dict)

    def heard(self, host: Host) -> None:
        """``host`` answered (a poll, or a new connection): its silence, if any, is over."""
        self.since.pop(host, None)
        self.refused.discard(host)

    def missed(self, host: Host, asked: float) -> None:
        """``host`` left a poll sent at ``asked`` unanswered."""
        self.since.setdefault(host, asked)

    def unreachable(self, host: Host, tried: float) -> None:
        """A new connection to ``host``, opened at ``tried``, failed."""
        self.since.setdefault(host, tried)
        self.refused.add(host)

    def polled(self, host: Host, answered: bool) -> None:
        """``host`` answered a status poll (a reply that reads), or did not: the count of
        those it left unanswered in a row."""
        if answered:
            self.misses.pop(host, None)
        else:
            self.misses[host] = self.misses.get(host, 0) + 1

    def recount(self) -> None:
        """The polls in a row count anew (a new connection, or a follower's watch)."""
        self.misses.clear()

    def gone(self, host: Host) -> bool:
        """The silence rule of a poll's view: ``host`` left ``MISSES`` status polls in a row
        unanswered, or a new connection could not reach it (no blip)."""
        return self.misses.get(host, 0) >= MISSES or host in self.refused

    def state(self, host: Host, now: float, bound: float) -> Heard:
        if host not in self.since:
            return Heard.ANSWERS
        if host not in self.refused:
            return Heard.SILENT
        if now >= self.since[host] + bound:
            return Heard.LOST
        return Heard.UNREACHABLE

    def silent(self, hosts: Sequence[Host]) -> list[Host]:
        """Those of ``hosts`` that do not answer (silent, unreachable or lost), in order."""
        return [host for host in hosts if host in self.since]

    def lost(self, hosts: Sequence[Host], now: float, bound: float) -> list[Host]:
        """Those of ``hosts`` that do not answer, when every one of them is LOST already;
        else none."""
        silent = self.silent(hosts)
        if any(self.state(host, now, bound) != Heard.LOST for host in silent):
            return []
        return silent

    def until(self, hosts: Sequence[Host], bound: float, now: float) -> float:
        """When every one of ``hosts`` that does not answer has not answered for ``bound`` s
        (none of them silent: ``now + bound``, the bound counted from now)."""
        starts = [self.since[host] for host in self.silent(hosts)]
        return max(starts, default=now) + bound

    def first(self, hosts: Sequence[Host], now: float) -> float:
        """When the first of ``hosts`` stopped answering (``now``: none did)."""
        return min((self.since[host] for host in self.silent(hosts)), default=now)

    def restart(self) -> None:
        """Every node's silence counts anew, from its next unanswered poll (``Majority``)."""
        self.since.clear()
        self.refused.clear()
        self.misses.clear()

    def forget(self, keep: Sequence[Host]) -> None:
        """Only ``keep`` is watched from now on (a new membership): the others' silence goes."""
        for host in [host for host in self.since if host not in keep]:
            self.heard(host)


def restartable(code: int, restart_on: Sequence[int]) -> bool:
    """Whether ``code`` restarts the job: any non-zero by default, else only the listed codes."""
    if code == 0:
        return False
    return not restart_on or code in restart_on


def decide(
    nodes: Sequence[NodeView],
    started: dict[int, float],
    restart_on: Sequence[int],
    restarts_left: int,
    stalled: str | None = None,
    replaceable: bool = False,
) -> Decision:
    """What to do after one poll. ``started`` is when each node's part of this attempt started
    (as first seen): a different start time means the node ran something else since (a reboot
    and someone's relaunch, say). ``stalled``: why the job counts as stalled (--restart-on-stall),
    a failure like any other. ``replaceable``: a node that does not answer may be replaced
    (--replace-after), which uses up no restart: nodes that do not answer are a REPLACE
    whatever ``restarts_left`` is, also beside other nodes' failures (a lost node's peers fail
    on their own within seconds: torchrun's, when the master goes). A fatal code still gives up
    first."""
    if nodes and all(node.state == JobState.EXITED and node.exit_code == 0 for node in nodes):
        return Decision(Action.DONE, None, "every node exited 0")
    problems: list[str] = []
    fatal: list[str] = []
    silent = 0  # problems that are nodes not answering
    rebooted = False
    for node in nodes:
        who = f"node {node.rank} ({node.host})"
        restarted = False  # its part of this attempt is not the one first seen
        if node.rank in started and node.started is not None:
            restarted = node.started != started[node.rank]
        if node.state == Heard.UNREACHABLE:
            problems.append(f"{who} is not answering")
            silent += 1
        elif node.state == JobState.ABSENT:
            problems.append(f"{who}: the job is gone there (rebooted, or ended outside meshkit)")
            rebooted = True
        elif restarted:
            problems.append(f"{who}: the job was restarted outside the supervisor")
        elif node.state == JobState.EXITED and node.exit_code not in (0, None):
            if restartable(node.exit_code, restart_on):
                problems.append(f"{who} exited with code {node.exit_code}")
            else:
                fatal.append(f"{who} exited with code {node.exit_code} (not in --restart-on)")
    cause = Cause.FAILURE
    if stalled and not problems:
        problems.append(stalled)
        cause = Cause.STALL
    elif silent and (replaceable or silent == len(problems)):
        cause = Cause.LOST  # with --replace-after, whatever the other nodes did meanwhile
    elif rebooted:
        cause = Cause.REBOOT
    told = restart_reason(nodes, stalled)
    if fatal:
        given = Cause.STALL if cause == Cause.STALL else Cause.FAILURE  # a stall among them
        return Decision(Action.GIVE_UP, given, "; ".join(fatal + problems), told)
    if not problems:
        return Decision(Action.WAIT)
    reason = "; ".join(problems)
    if cause == Cause.LOST and replaceable:
        return Decision(Action.REPLACE, cause, reason, told)
    if restarts_left <= 0:
        return Decision(Action.GIVE_UP, cause, f"no restarts left; last failure: {reason}", told)
    return Decision(Action.RESTART, cause, reason, told)


def restart_reason(nodes: Sequence[NodeView], stalled: str | None) -> RestartReason:
    """What every rank of the relaunch is told happened (``MESHKIT_RESTART_REASON``)."""
    if any(node.state == JobState.ABSENT for node in nodes):
        return RestartReason.REBOOT
    failed = any(node.state != JobState.RUNNING for node in nodes)
    if stalled and not failed:
        return RestartReason.STALL
    return RestartReason.FAILURE


def waited_only(seen: Supervision, current: Supervision) -> bool:
    """Whether ``current`` is ``seen`` but for a note of which nodes a relaunch waits for (the
    leader's own, while it waits): the relaunch ``seen`` led to may go on."""
    if current == seen:
        return True
    if current.waiting is None:
        return False
    return replace(current, version=seen.version, by=seen.by, waiting=seen.waiting) == seen


def backoff(restart_number: int, base: float = BACKOFF, cap: float = MAX_BACKOFF) -> float:
    """Seconds to wait before relaunch number ``restart_number`` (1, 2, ...)."""
    # The cap is reached long before 64 doublings; bounding them keeps an absurd attempt
    # number (a damaged record copy) from overflowing the float.
    doublings = min(max(0, restart_number - 1), 64)
    return float(min(cap, base * 2**doublings))


def views(rows: Sequence[StatusRow], hosts: Sequence[Host], silence: Silence) -> list[NodeView]:
    """Status rows (of ``hosts``, by rank) as the policy sees them, each counted in
    ``silence``: a node that does not answer is UNREACHABLE once ``silence`` takes it as gone;
    before that it is taken to be as it was (``running``)."""
    seen = []
    for row in rows:
        host = hosts[row.node_rank]
        silence.polled(host, answered=not row.error)
        if row.error:
            state: JobState | Heard = JobState.RUNNING
            if silence.gone(host):
                state = Heard.UNREACHABLE
            seen.append(NodeView(row.node_rank, row.host, state))
            continue
        stamp = None
        if row.started:
            stamp = datetime.datetime.fromisoformat(row.started).timestamp()
        seen.append(NodeView(row.node_rank, row.host, row.state, row.exit_code, stamp))
    return seen


def next_step(me: int, live: set[int], record: Supervision | None) -> Step:
    """What the supervisor of rank ``me`` does, given the ranks whose supervisors are live and
    the newest record. A claimed relaunch is finished by its claimer while that one lives, else
    by the leader (the lowest live rank); it is never begun anew."""
    if record is None or record.supervisor in (SupervisorState.DONE, SupervisorState.GAVE_UP):
        return Step.END
    if record.supervisor == SupervisorState.STOPPED:
        return Step.STOP
    relaunching = record.supervisor == SupervisorState.RELAUNCHING
    if relaunching and record.by in live:
        return Step.RESUME if record.by == me else Step.FOLLOW
    if leader(live | {me}) != me:
        return Step.FOLLOW
    return Step.RESUME if relaunching else Step.WATCH


def evictable(
    nodes: Sequence[NodeView],
    health: dict[int, NodeHealth | None],
    level: str,
    noted: Sequence[str],
) -> dict[str, str]:
    """Pure: the members whose health evicts them (``unhealthy``, or with ``level`` "degraded"
    that too; ``unknown`` never), each with why, but those ``noted`` ("NODE: why": no spare
    could take their rank, the job runs on them)."""
    worst = HealthState.DEGRADED if level == "degraded" else HealthState.UNHEALTHY
    skip = {line.split(": ", 1)[0] for line in noted}
    found = {}
    for view in nodes:
        reading = health.get(view.rank)
        if reading is None or view.host in skip:
            continue
        if reading.state != HealthState.UNKNOWN and at_least(reading, worst):
            found[view.host] = f"{reading.state}: {'; '.join(reading.reasons)}"
    return found


def failed_start(started: float | None, failed: float, window: float) -> bool:
    """Pure: an attempt that started at ``started`` (wall time; None: not known) and failed at
    ``failed`` failed within ``window`` seconds: it failed to start."""
    return started is not None and failed - started < window


def crashed(quick: Sequence[str], limit: int) -> bool:
    """Pure: ``limit`` failed starts in a row (``quick``; 0: never) end supervision."""
    return limit > 0 and len(quick) >= limit
