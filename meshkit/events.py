"""A job's history, pure: one ``Event`` per thing that happened to it (a launch, an attempt, a
failure with its ``Blame``, a restart, an eviction, ...), kept on every node of the job
(``meshkit.node.events``) and merged when read (``merge``), so losing any node, the leader's
included, loses nothing. Standard library only: the node side imports this.
"""

from __future__ import annotations

import os

from .record import Count, ExitCode, Index, StrEnum, WallTime, field, record


class EventKind(StrEnum):
    """What happened (the names ``events --json`` and ``train --notify-on`` use)."""

    LAUNCHED = "launched"  # train started the job (attempt 1)
    ATTEMPT = "attempt"  # a relaunched attempt started on every node
    FAILED = "failed"  # an attempt failed: its ``blame`` says where and why
    RESTARTED = "restarted"  # the supervisor relaunches (a restart used)
    STALLED = "stalled"  # no output (or no step) for --stall-after
    HEALTH = "health"  # a node's health changed (ok, degraded, unhealthy, unknown)
    LOST = "lost"  # a node did not answer within --replace-after
    REPLACED = "replaced"  # a spare took a rank
    EVICTED = "evicted"  # a node put out of the job: unhealthy, degraded, or a lemon
    SHRUNK = "shrunk"  # the job goes on with fewer nodes (--min-nodes)
    READMITTED = "readmitted"  # train --readmit NODE
    NO_SPARE = "no_spare"  # an unhealthy node no spare can replace: the job runs on it
    STRAGGLER = "straggler"  # a node slower than the others (progress)
    GAVE_UP = "gave_up"  # the supervision gave up ("restarting is not helping", ...)
    DONE = "done"  # every node exited 0
    STOPPED = "stopped"  # meshkit stop
    NOTIFY_FAILED = "notify_failed"  # the --notify command failed or timed out


NOTIFY_DEFAULT = (
    EventKind.FAILED,
    EventKind.EVICTED,
    EventKind.REPLACED,
    EventKind.SHRUNK,
    EventKind.GAVE_UP,
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
        """``events --json``'s object (and what ``--notify`` reads on stdin): ``time`` in ISO
        8601 UTC, ``detail`` the line people read, ``cause`` the blame (null: none)."""
        import datetime

        from .record import asdict

        stamp = datetime.datetime.fromtimestamp(self.time, datetime.timezone.utc)
        cause = None if self.blame is None else asdict(self.blame)
        return {
            "time": stamp.isoformat(timespec="seconds").replace("+00:00", "Z"),
            "kind": str(self.kind),
            "node": self.node,
            "rank": self.rank,
            "generation": self.generation,
            "attempt": self.attempt,
            "cause": cause,
            "detail": self.text,
            "launch": self.launch,
            "by": self.by,
            "id": self.id,
        }


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
