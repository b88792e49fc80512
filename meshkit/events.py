"""A job's history, pure: one ``Event`` per thing that happened to it (a launch, an attempt, a
failure with its ``Blame``, a restart, an eviction, ...), kept on every node of the job
(``meshkit.node.events``) and merged when read (``merge``), so losing any node, the leader's
included, loses nothing. Standard library only: the node side imports this.
"""

from __future__ import annotations

import os

from .record import Count, ExitCode, Index, StrEnum, WallTime, field, record


class EventKind(StrEnum):
    """What happened. ``train --notify-on`` names these."""

    LAUNCH = "launch"  # train started the job (attempt 1)
    ATTEMPT = "attempt"  # an attempt started on every node
    FAILURE = "failure"  # an attempt failed: its ``blame`` says where and why
    RESTART = "restart"  # the supervisor relaunches (a restart used)
    STALL = "stall"  # no output (or no step) for --stall-after
    HEALTH = "health"  # a node's health changed (ok, degraded, unhealthy)
    LOST = "lost"  # a node did not answer within --replace-after
    REPLACEMENT = "replacement"  # a spare took a rank
    EVICTION = "eviction"  # a node put out of the job: unhealthy, degraded, or a lemon
    SHRINK = "shrink"  # the job goes on with fewer nodes (--min-nodes)
    READMISSION = "readmission"  # train --readmit NODE
    NO_SPARE = "no spare"  # an unhealthy node that no spare can replace: the job runs on it
    GIVE_UP = "give-up"  # the supervision gave up
    DONE = "done"  # every node exited 0
    STOP = "stop"  # meshkit stop
    NOTIFY_FAILED = "notify failed"  # the --notify command failed or timed out


NOTIFY_DEFAULT = (
    EventKind.FAILURE,
    EventKind.EVICTION,
    EventKind.REPLACEMENT,
    EventKind.SHRINK,
    EventKind.GIVE_UP,
    EventKind.DONE,
)


@record
class Blame:
    """Where a failure or a stall happened and why, as far as can be told: the first-failing
    rank (``rank``, global; None: not known) and its node (``node``, as the hostfile spells it;
    ``node_rank``), its exit code or signal, the node's health findings near that time, and the
    rank's last log lines. ``attributed``: the node is to blame (it failed first, or is
    unhealthy), which counts towards --evict-after."""

    node: str | None = None
    node_rank: Index | None = None
    rank: Index | None = None
    exit_code: ExitCode | None = None
    signal: str | None = None  # "SIGKILL" for an exit code past 128
    health: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    error: str | None = None  # the rank's exception, when its error file says
    attributed: bool = False


@record
class Event:
    """One thing that happened to a job: when (``time``, the writer's wall clock), what
    (``kind``), where (``node`` as the hostfile spells it, its ``rank``) and in which
    ``generation`` and ``attempt``; ``text`` is the line people read; ``blame`` a failure's
    cause. ``id`` is unique, so the copies on every node merge into one."""

    id: str
    time: WallTime
    kind: EventKind
    text: str
    launch: str = ""
    generation: Count = 1
    attempt: Count = 1
    node: str | None = None
    rank: Index | None = None
    blame: Blame | None = None
    by: str = ""  # who wrote it: "supervisor of node 0", "train", "stop"

    def as_json(self) -> dict[str, object]:
        from .record import asdict

        return asdict(self)


def new_id() -> str:
    """A unique event id (16 hex digits)."""
    return os.urandom(8).hex()


def merge(copies: list[list[Event]]) -> list[Event]:
    """Every node's copy of the history as one: each event once (by ``id``), oldest first."""
    seen: dict[str, Event] = {}
    for events in copies:
        for event in events:
            seen.setdefault(event.id, event)
    return sorted(seen.values(), key=lambda event: (event.time, event.id))
