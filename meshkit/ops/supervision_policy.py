"""The supervisor's policy, pure: how one poll's status rows look to it (``views``), what to do
about them (``decide``), how long to wait before a relaunch (``backoff``), and what each
supervisor does next (``next_step``). The loop around it is ``ops.supervise``.

The supervision's states (``protocol.SupervisorState``), one record per job with a copy on every
node, written by compare-and-set (``ops.supervision``)::

                  claim (every node answering)                 launched
      RUNNING  ---------------------------------> RELAUNCHING ---------> RUNNING (attempt + 1)
         |  every node exited 0 ------> DONE           |
         |  a fatal code, no restarts -> GAVE UP       +-- nodes gone, held past 300 s -> GAVE UP

      any state  ---- meshkit stop ---->  STOPPED

1. ``RUNNING``: the attempt runs; the leader, the lowest live rank, watches it (``decide``).
2. ``RELAUNCHING``: rank ``by`` claimed the next attempt and makes it; if it is gone, the
   leader finishes the same attempt (``RESUME``), never a new one.
3. ``DONE``, ``GAVE UP``: final; every supervisor ends (``END``).
4. ``STOPPED``: final, and it wins over every other record whatever the versions
   (``Supervision.precedence``; a node replaces it with nothing but another stop), so a
   supervisor that ``stop`` could not reach (a partition) and that counted versions on its own
   side still finds it once it reconnects. It relaunches nothing: a stop ends the whole job, so
   it ends the job on the nodes whose copy does not say stopped yet (the ones the stop did not
   reach), leaves the record there, and ends (``STOP``).
5. A node that does not answer within ``--replace-after`` is lost: the leader claims RELAUNCHING
   with a new ``generation`` and ``members`` (``ops.membership``: a spare takes its rank, or the
   job shrinks with ``--min-nodes``); a replacement does not use up ``restarts_left``. Every
   supervisor follows the newest generation; one whose node is in none is fenced: it ends what
   its node runs of the job, and its node is a spare from then on.

How a node that stops answering becomes lost (``Silence``, one state per node)::

                 a poll unanswered              a new connection fails too
      ANSWERS  ---------------------> SILENT  -----------------------------> UNREACHABLE
         ^      (since: that poll's start)                                      |
         +------------- it answers a poll, or a new connection reaches it ------+
                                                                                |
                                                   since + --replace-after      v
                                                 ------------------------->   LOST

The bound counts from the first poll the node left unanswered, the moment it stopped answering,
not from when the leader noticed: a poll waits its own bound before it counts as unanswered, and
a new connection its connect timeout, and both run inside ``--replace-after`` instead of before
it. A node is lost only once a new connection failed as well (a wedged channel to a live node is
not a lost node).
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..hostfile import Host
from ..protocol import JobState, RestartReason, Supervision, SupervisorState
from ..record import StrEnum, replace
from .jobs import StatusRow

MISSES = 2  # consecutive unanswered polls before a node counts as gone (one blip is no failure)
BACKOFF = 2.0  # seconds before the first relaunch, doubled for each later one
MAX_BACKOFF = 60.0


class Unanswered(StrEnum):
    """A node's state, as the supervisor sees it, once it did not answer ``MISSES`` polls in a
    row."""

    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class NodeView:
    """One node as the supervisor sees it in one poll."""

    rank: int
    host: str
    state: JobState | Unanswered
    exit_code: int | None = None
    started: float | None = None


class Action(StrEnum):
    """What a poll asks for besides ending the supervision (DONE, GAVE_UP)."""

    WAIT = "wait"
    RESTART = "restart"


@dataclass(frozen=True)
class Decision:
    action: Action | Literal[SupervisorState.DONE, SupervisorState.GAVE_UP]
    reason: str | None = None


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


@dataclass
class Silence:
    """Since when each node has not answered (the start of the first poll it left unanswered),
    and which of them a new connection could not reach either: the state machine above, over
    monotonic times the caller gives (pure)."""

    since: dict[Host, float] = field(default_factory=dict)
    refused: set[Host] = field(default_factory=set)

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

    def until(self, hosts: Sequence[Host], bound: float, now: float) -> float:
        """When every one of ``hosts`` that does not answer has not answered for ``bound`` s
        (none of them silent: ``now + bound``, the bound counted from now)."""
        starts = [self.since[host] for host in self.silent(hosts)]
        return max(starts, default=now) + bound

    def first(self, hosts: Sequence[Host], now: float) -> float:
        """When the first of ``hosts`` stopped answering (``now``: none did)."""
        return min((self.since[host] for host in self.silent(hosts)), default=now)

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
) -> Decision:
    """What to do after one poll. ``started`` is when each node's part of this attempt started
    (as first seen): a different start time means the node ran something else since (a reboot
    and someone's relaunch, say). ``stalled``: why the job counts as stalled (--restart-on-stall),
    a failure like any other."""
    if nodes and all(node.state == JobState.EXITED and node.exit_code == 0 for node in nodes):
        return Decision(SupervisorState.DONE, "every node exited 0")
    problems: list[str] = []
    fatal: list[str] = []
    for node in nodes:
        who = f"node {node.rank} ({node.host})"
        restarted = False  # its part of this attempt is not the one first seen
        if node.rank in started and node.started is not None:
            restarted = node.started != started[node.rank]
        if node.state == Unanswered.UNREACHABLE:
            problems.append(f"{who} is not answering")
        elif node.state == JobState.ABSENT:
            problems.append(f"{who}: the job is gone there (rebooted, or ended outside meshkit)")
        elif restarted:
            problems.append(f"{who}: the job was restarted outside the supervisor")
        elif node.state == JobState.EXITED and node.exit_code not in (0, None):
            if restartable(node.exit_code, restart_on):
                problems.append(f"{who} exited with code {node.exit_code}")
            else:
                fatal.append(f"{who} exited with code {node.exit_code} (not in --restart-on)")
    if stalled and not problems:
        problems.append(stalled)
    if fatal:
        return Decision(SupervisorState.GAVE_UP, "; ".join(fatal + problems))
    if not problems:
        return Decision(Action.WAIT)
    reason = "; ".join(problems)
    if restarts_left <= 0:
        return Decision(SupervisorState.GAVE_UP, f"no restarts left; last failure: {reason}")
    return Decision(Action.RESTART, reason)


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


def views(
    rows: Sequence[StatusRow], misses: dict[int, int], refused: Collection[int] = ()
) -> list[NodeView]:
    """Status rows as the policy sees them: a node that did not answer ``MISSES`` polls in a row
    is ``unreachable``; before that it is taken to be as it was (``running``). A node in
    ``refused`` (ranks a new connection could not reach after a missed poll: no blip) is
    ``unreachable`` at once."""
    seen = []
    for row in rows:
        if row.error:
            misses[row.node_rank] = misses.get(row.node_rank, 0) + 1
            state: JobState | Unanswered = JobState.RUNNING
            if misses[row.node_rank] >= MISSES or row.node_rank in refused:
                state = Unanswered.UNREACHABLE
            seen.append(NodeView(row.node_rank, row.host, state))
            continue
        misses.pop(row.node_rank, None)
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
    leader = min(live | {me})
    if leader != me:
        return Step.FOLLOW
    return Step.RESUME if relaunching else Step.WATCH
